"""Integer rounding shared by every layer: block counts and sizes padded to a multiple.

Torch-free: the functions use only `+`, `-` and `//`, so they take Python ints and, unchanged, integer
tensors of counts (the dispatchers round per-expert row counts on the device without a host sync).
"""

from __future__ import annotations

from typing import TypeVar

N = TypeVar("N")


def ceil_div(n: N, d: int) -> N:
    """How many blocks of `d` cover `n` (an int, or a tensor of counts): ceil(n / d), exact for ints."""
    return (n + d - 1) // d  # type: ignore[operator, return-value]


def round_up(n: N, multiple: int) -> N:
    """`n` (an int, or a tensor of counts) rounded up to a multiple of `multiple`."""
    return ceil_div(n, multiple) * multiple  # type: ignore[operator, return-value]
