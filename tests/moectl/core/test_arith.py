"""`moectl.core.arith`: ceil_div and round_up against math.ceil, for ints and for integer count tensors."""

from __future__ import annotations

import math

import torch

from moectl.core.arith import ceil_div, round_up


def test_ints_match_math_ceil() -> None:
    for d in range(1, 33):
        for n in range(-5, 100):
            assert ceil_div(n, d) == math.ceil(n / d), (n, d)
            assert round_up(n, d) == math.ceil(n / d) * d, (n, d)


def test_count_tensors_round_elementwise_on_their_device() -> None:
    counts = torch.tensor([0, 1, 15, 16, 17, 33], dtype=torch.int64)
    assert round_up(counts, 16).tolist() == [0, 16, 16, 16, 32, 48]
    assert ceil_div(counts, 16).tolist() == [0, 1, 1, 1, 2, 3]
    assert round_up(counts, 16).dtype == torch.int64
