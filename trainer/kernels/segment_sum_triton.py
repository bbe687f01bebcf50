"""Triton kernel: per-expert row sums (the expert biases' grads) with the counts read on the device.

`torch.segment_reduce` sums each expert's rows in order, but on CUDA it copies the segment lengths to the
host, so a step with expert biases could not be captured in a CUDA graph (MOE066, seventeenth session). Here
each program owns one expert and one block of columns: it reads the expert's row range from the device
offsets, adds BLOCK_T rows at a time into an fp32 tile in ascending row order, then sums the tile's rows.
The order is fixed by the shapes alone, so the sums are the same bits run to run and in a graph replay as
eagerly (no atomics); they differ from `segment_reduce`'s in rounding only.

Imported lazily on CUDA only; importing it needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 32  # rows added per loop step
BLOCK_X = 128  # columns per program


@triton.jit
def _segment_sum_kernel(v_ptr, offsets_ptr, out_ptr, X, stride_t, stride_x, BLOCK_T: tl.constexpr,
                        BLOCK_X: tl.constexpr):  # fmt: skip
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_X + tl.arange(0, BLOCK_X)
    in_cols = cols < X
    col_offs = cols.to(tl.int64) * stride_x  # a transposed input's column stride is T: past 2^31 at T * X
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_T, BLOCK_X), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        rows = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask = (rows < end)[:, None] & in_cols[None, :]
        acc += tl.load(v_ptr + rows[:, None] * stride_t + col_offs[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + e.to(tl.int64) * X + cols, tl.sum(acc, axis=0), mask=in_cols)


def segment_sum(v_TX: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """`[E, X]` fp32: row `e` is the sum of `v_TX`'s rows of expert `e` (the experts' rows consecutive, in
    expert order, as the counts say; rows past their total are not read). No host sync."""
    if v_TX.dim() != 2 or tokens_per_expert_E.dim() != 1:
        raise ValueError(f"segment_sum takes [T, X] rows and [E] counts, got {tuple(v_TX.shape)} and "
                         f"{tuple(tokens_per_expert_E.shape)}")  # fmt: skip
    E, X = tokens_per_expert_E.shape[0], v_TX.shape[1]
    offsets = torch.zeros(E + 1, dtype=torch.int64, device=v_TX.device)
    torch.cumsum(tokens_per_expert_E, 0, out=offsets[1:])
    out = torch.empty(E, X, dtype=torch.float32, device=v_TX.device)
    if E and X:
        _segment_sum_kernel[(E, triton.cdiv(X, BLOCK_X))](v_TX, offsets, out, X, *v_TX.stride(), BLOCK_T=BLOCK_T,
                                                          BLOCK_X=BLOCK_X)  # fmt: skip
    return out
