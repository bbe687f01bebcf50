"""Tiling a `[..., M, K]` tensor into `bh x bw` blocks, for the block-scaled kinds.

The last (contraction) dim is cut into blocks of `bw`; with `bh > 1` (2-D weight tiles, 128x128 or
16x16) the rows are cut into `bh` as well. Shapes that do not divide are zero-padded for the amax (zeros
never raise a max of absolute values) and the padding is dropped again, so a partial last block is
quantized as if the block were full of zeros there (what TE's kernels do at a ragged edge).
"""

from __future__ import annotations

import torch

from moectl.core.arith import ceil_div
from trainer.kernels.fp8_transpose_triton import transpose_torch
import torch.nn.functional as F


def num_blocks(n: int, b: int) -> int:
    """Blocks of size `b` covering `n` elements."""
    return ceil_div(n, b)


def to_blocks(x: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    """`[..., M, K]` -> `[..., M/bh, bh, K/bw, bw]` (rounded up, zero padded)."""
    M, K = x.shape[-2], x.shape[-1]
    Mb, Kb = num_blocks(M, bh), num_blocks(K, bw)
    if Mb * bh != M or Kb * bw != K:
        x = F.pad(x, (0, Kb * bw - K, 0, Mb * bh - M))
    return x.reshape(*x.shape[:-2], Mb, bh, Kb, bw)


def from_blocks(xb: torch.Tensor, M: int, K: int) -> torch.Tensor:
    """Inverse of `to_blocks`: `[..., Mb, bh, Kb, bw]` -> `[..., M, K]` without the padding."""
    Mb, bh, Kb, bw = xb.shape[-4:]
    x = xb.reshape(*xb.shape[:-4], Mb * bh, Kb * bw)
    if Mb * bh != M or Kb * bw != K:
        x = x[..., :M, :K]
    return x.contiguous()


def block_amax(x: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    """Max of |x| per block: `[..., M, K]` -> `[..., M/bh, K/bw]`. NaN propagates."""
    return to_blocks(x.abs(), bh, bw).amax(dim=(-3, -1))


def per_block(s: torch.Tensor) -> torch.Tensor:
    """Reshape block values `[..., Mb, Kb]` to broadcast against `to_blocks` output."""
    return s.unsqueeze(-1).unsqueeze(-3)


def transposed(x: torch.Tensor) -> torch.Tensor:
    """`x` with its last two dims swapped, in standard contiguous strides (the eager transpose the kernels'
    fallback runs)."""
    return transpose_torch(x)
