"""Triton kernel: the embedding's weight grad added into its fp32 `main_grad`, rows of seen tokens only.

Through autograd the embedding's backward writes a dense bf16 grad of the whole `[V, D]` table (a zero
fill, a sort, two segment kernels), which the grad buffer's hook then adds into the fp32 `main_grad`: about
0.5 ms per micro-batch for the reference model's 32,000 x 2,048 table, of which the full-table add is half.
Here the token ids arrive sorted (a stable sort of the `B*S` ids), so each token's grad rows are one run.
A program owns BLOCK_P consecutive sorted places (and BLOCK_D columns): it loads their grad rows into one
fp32 tile, sums each run by a segmented scan down the tile, and adds each run's sum into that token's
`main_grad` row once, at the run's last place in the tile. A run belongs to the program where it starts; one
that goes on past the tile is finished by a second launch, BLOCK_T rows at a time. Only seen rows are read and written,
nothing is rounded to bf16, and the order of every sum is fixed by the ids alone (no atomics): the same bits
run to run and in a graph. The first version gave every sorted place a program of its own, which found its
run start or returned, most programs idle: at the reference shape (8,192 ids, a 32,000 x 2,048 table) on an
H100, 584 us for uniform ids and 307 us for Zipf-like ones, against 93 and 122 us now (`BLOCK_P`, `BLOCK_D`
the best of six configs; docs/benchmarks.md).

Imported lazily on CUDA only; importing it needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_P = 32  # sorted places per program
BLOCK_D = 128  # columns per program
BLOCK_T = 16  # rows per loop step of a run that goes on past its program's places


@triton.jit
def _run_sum(start_a, sum_a, start_b, sum_b):
    # a segmented scan's step: the right part's sum alone where a run starts in it (int32 flags: the compiler
    # of Triton 3.6 fails on a scan that carries i1)
    return start_a | start_b, tl.where(start_b != 0, sum_b, sum_a + sum_b)


@triton.jit
def _embedding_grad_kernel(tok_ptr, order_ptr, g_ptr, out_ptr, N, D, BLOCK_P: tl.constexpr,
                           BLOCK_D: tl.constexpr):  # fmt: skip
    p0 = tl.program_id(0) * BLOCK_P
    p = p0 + tl.arange(0, BLOCK_P)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    c_ok = cols < D
    p_ok = p < N
    has_next = p + 1 < N
    # masked lanes read no sentinel: the ids may be unsigned (uint8 for a small vocabulary)
    tok = tl.load(tok_ptr + p, mask=p_ok, other=0)
    prev = tl.load(tok_ptr + tl.maximum(p - 1, 0), mask=p_ok, other=0)
    nxt = tl.load(tok_ptr + p + 1, mask=has_next, other=0)
    starts = (p == 0) | (prev != tok)
    before = tl.load(tok_ptr + tl.maximum(p0 - 1, 0))  # the token of the place before this program's first
    owned = (p0 == 0) | (tok != before)  # the run started here, not in an earlier program
    last = p == p0 + BLOCK_P - 1
    # a run's last place here (its last place, or this program's last with the run going on): its sum is added
    keep = p_ok & owned & (last | ~has_next | (nxt != tok))
    src = tl.load(order_ptr + p, mask=p_ok, other=0).to(tl.int64)
    g = tl.load(g_ptr + src[:, None] * D + cols[None, :], mask=p_ok[:, None] & c_ok[None, :], other=0.0)
    starts_PD = tl.broadcast_to(starts.to(tl.int32)[:, None], (BLOCK_P, BLOCK_D))
    _, run_sum = tl.associative_scan((starts_PD, g.to(tl.float32)), axis=0, combine_fn=_run_sum)
    out = out_ptr + tok.to(tl.int64)[:, None] * D + cols[None, :]
    m = keep[:, None] & c_ok[None, :]
    tl.store(out, tl.load(out, mask=m, other=0.0) + run_sum, mask=m)


@triton.jit
def _run_rest_kernel(tok_ptr, order_ptr, g_ptr, out_ptr, N, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_T: tl.constexpr):  # fmt: skip
    # after `_embedding_grad_kernel`: the run a program owns that goes on past its last place (at most one per
    # program) gets its remaining rows, BLOCK_T at a time. A second launch: with this loop in the scan's
    # kernel, Triton 3.6's compiler fails (TritonGPURemoveLayoutConversions).
    p0 = tl.program_id(0) * BLOCK_P
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    c_ok = cols < D
    j = p0 + BLOCK_P
    if j < N:
        tail = tl.load(tok_ptr + j - 1)
        before = tl.load(tok_ptr + tl.maximum(p0 - 1, 0))
        if ((p0 == 0) | (tail != before)) & (tl.load(tok_ptr + j) == tail):
            acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            more = tail == tail
            while more:
                rows = j + tl.arange(0, BLOCK_T)
                in_ids = rows < N
                hit = in_ids & (tl.load(tok_ptr + rows, mask=in_ids, other=0) == tail)
                src = tl.load(order_ptr + rows, mask=hit, other=0).to(tl.int64)
                acc += tl.load(g_ptr + src[:, None] * D + cols[None, :], mask=hit[:, None] & c_ok[None, :],
                               other=0.0).to(tl.float32)  # fmt: skip
                more = tl.sum(hit.to(tl.int32), axis=0) == BLOCK_T
                j += BLOCK_T
            row = out_ptr + tail.to(tl.int64) * D + cols
            tl.store(row, tl.load(row, mask=c_ok, other=0.0) + tl.sum(acc, axis=0), mask=c_ok)


def add_embedding_grad(main_grad_VD: torch.Tensor, sorted_ids_N: torch.Tensor, order_N: torch.Tensor,
                       g_ND: torch.Tensor) -> None:  # fmt: skip
    """`main_grad[ids[n]] += g[n]` for every n, with `sorted_ids = ids[order]` sorted (stable): each token's
    rows summed in fp32 in an order fixed by the ids, then added once (twice for a run that
    spans programs: its first program's part, then the rest)."""
    N, D = g_ND.shape
    if main_grad_VD.dtype != torch.float32 or not main_grad_VD.is_contiguous() or main_grad_VD.shape[1] != D:
        raise ValueError(f"add_embedding_grad: main_grad {tuple(main_grad_VD.shape)} {main_grad_VD.dtype}, grad D={D}")
    if N == 0:
        return
    grid = (triton.cdiv(N, BLOCK_P), triton.cdiv(D, BLOCK_D))
    args = (sorted_ids_N, order_N, g_ND.contiguous(), main_grad_VD, N, D)
    _embedding_grad_kernel[grid](*args, BLOCK_P=BLOCK_P, BLOCK_D=BLOCK_D, num_warps=4)
    _run_rest_kernel[grid](*args, BLOCK_P=BLOCK_P, BLOCK_D=BLOCK_D, BLOCK_T=BLOCK_T, num_warps=4)
