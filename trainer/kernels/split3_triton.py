"""Triton kernels: the router's fp32 tensors split into bf16 parts in one launch (trainer/moe/router_gemm.py).

`split3` in torch is eight small launches (casts, subtractions, a stack) per split, and the backward's
operands two `cat`s and a transposed copy more: about 25 launches per layer and micro-batch, ~35 us of a
graph-replayed step's device time each time. Here each split is one elementwise pass with the same three
roundings (`hi = bf16(w)`, `mid = bf16(w - hi)`, `lo = bf16(w - hi - mid)`, round to nearest even), so the
parts are the torch function's bit for bit:

    split_rows(w_ED)    -> [4E, D]  rows [lo; hi; mid; hi]  the forward's weight operand (the first 3E
                                                         rows) and the data grad's (the last 3E)
    split_cols(g_TE)    -> [T, 3E]  columns [hi | mid | lo]  the weight grad's operand, read transposed
                           [T, 3E]  columns [hi | hi | mid]  the data grad's operand

Imported lazily on CUDA only; importing it needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_R, _BLOCK_C = 16, 128


@triton.jit
def _parts(w):
    hi = w.to(tl.bfloat16, fp_downcast_rounding="rtne")
    r = w - hi.to(tl.float32)
    mid = r.to(tl.bfloat16, fp_downcast_rounding="rtne")
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
    return hi, mid, lo


@triton.jit
def _split_rows_kernel(w_ptr, out_ptr, R, C, PART, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < R)[:, None] & (c < C)[None, :]
    at = r.to(tl.int64)[:, None] * C + c[None, :]
    hi, mid, lo = _parts(tl.load(w_ptr + at, mask=ok, other=0.0))
    tl.store(out_ptr + at, lo, mask=ok)
    tl.store(out_ptr + PART + at, hi, mask=ok)
    tl.store(out_ptr + 2 * PART + at, mid, mask=ok)
    tl.store(out_ptr + 3 * PART + at, hi, mask=ok)


@triton.jit
def _split_cols_kernel(g_ptr, parts_ptr, lhs_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < R)[:, None] & (c < C)[None, :]
    hi, mid, lo = _parts(tl.load(g_ptr + r.to(tl.int64)[:, None] * C + c[None, :], mask=ok, other=0.0))
    row = r.to(tl.int64)[:, None] * (3 * C) + c[None, :]
    tl.store(parts_ptr + row, hi, mask=ok)
    tl.store(parts_ptr + row + C, mid, mask=ok)
    tl.store(parts_ptr + row + 2 * C, lo, mask=ok)
    tl.store(lhs_ptr + row, hi, mask=ok)
    tl.store(lhs_ptr + row + C, hi, mask=ok)
    tl.store(lhs_ptr + row + 2 * C, mid, mask=ok)


def _grid(R: int, C: int) -> tuple[int, int]:
    return triton.cdiv(R, _BLOCK_R), triton.cdiv(C, _BLOCK_C)


def split_rows(w_ED: torch.Tensor) -> torch.Tensor:
    """`[4E, D]` bf16: the parts of `split3(w)` as rows `[lo; hi; mid; hi]` (`w` fp32, contiguous)."""
    E, D = w_ED.shape
    out = torch.empty(4 * E, D, dtype=torch.bfloat16, device=w_ED.device)
    if w_ED.numel():
        _split_rows_kernel[_grid(E, D)](w_ED, out, E, D, E * D, BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, num_warps=4)
    return out


def split_cols(g_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`([g_hi | g_mid | g_lo], [g_hi | g_hi | g_mid])`, each `[T, 3E]` bf16 (`g` fp32, contiguous)."""
    T, E = g_TE.shape
    parts = torch.empty(T, 3 * E, dtype=torch.bfloat16, device=g_TE.device)
    lhs = torch.empty_like(parts)
    if g_TE.numel():
        _split_cols_kernel[_grid(T, E)](g_TE, parts, lhs, T, E, BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, num_warps=4)
    return parts, lhs
