"""Row-block views as block tables: where each fixed-size block of a strided view lies in its storage.

Muon's fused elementwise kernels (`kernels/muon_triton.py`) run one program per BLOCK-element block. A
contiguous tensor's block b lies at b; a row-block view (`[G, r, n]` blocks of whole rows, such as the query
part of a fused QKV weight across its query groups, `optim/muon.qkv_parts`) is read block by block through a
table of block offsets from its first element, in the view's element order. Free of Triton, so the CPU
tests check the table against the view itself.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch


def block_table(t: torch.Tensor, block: int) -> Optional[torch.Tensor]:
    """Where each `block`-element block of row-block view `t` (`[..., r, n]`, rows contiguous) starts, in blocks
    from `t`'s first element, in `t`'s element order: an int64 table on `t`'s device; None for a contiguous `t`
    (block b at b). Raises ValueError for a layout whose blocks are not whole rows of whole row blocks."""
    if t.is_contiguous():
        return None
    return _table(tuple(t.shape), tuple(t.stride()), t.device, block)


@lru_cache(maxsize=None)
def _table(shape: tuple[int, ...], stride: tuple[int, ...], device: torch.device, block: int) -> torch.Tensor:
    *lead, r, n = shape
    if len(shape) < 3 or stride[-1] != 1 or stride[-2] != n or (r * n) % block or any(s % block for s in stride[:-2]):
        raise ValueError(f"Muon's fused kernels take contiguous tensors or whole-block row-block views, got shape "
                         f"{shape} strides {stride}")
    per = r * n // block
    starts = torch.zeros((), dtype=torch.int64)
    for size, step in zip(lead, stride[:-2]):
        starts = (starts.unsqueeze(-1) + torch.arange(size) * (step // block)).flatten()
    return (starts.unsqueeze(-1) + torch.arange(per)).flatten().to(device)


def takes(t: torch.Tensor, block: int) -> bool:
    """Whether `t` is contiguous or a row-block view of whole `block`-element blocks."""
    try:
        block_table(t, block)
    except ValueError:
        return False
    return True


def same_layout(kernel: str, t: torch.Tensor, other: torch.Tensor) -> None:
    """`other` (a momentum, a published param) is laid out as `t`, so one block table serves both."""
    if other.shape != t.shape or (not (t.is_contiguous() and other.is_contiguous()) and other.stride() != t.stride()):
        raise ValueError(f"Muon's fused {kernel}: {tuple(other.shape)} strides {other.stride()} is not laid out as "
                         f"{tuple(t.shape)} strides {t.stride()}")
