"""Triton kernel: the router's top-k expert ids, best first, one row of scores per token.

`torch.topk` on CUDA is two launches for a router's `[T, E]` scores (a radix select, then a bitonic sort of
the k winners): ~25 us per layer and micro-batch at the reference shape for a 1 MB input. Here one program
holds a tile of rows and picks the k best ids by k rounds of max-and-mask over the ids not chosen yet (so no
id repeats); of equal scores the lower id wins, and NaN ranks above every score, as in `torch.topk`.
The values are not returned: the router gathers them from its scores, so autograd sees a plain gather.

Imported lazily on CUDA only; importing it needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_ids_kernel(s_ptr, idx_ptr, T, E, K: tl.constexpr, BLOCK_T: tl.constexpr, EP: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, EP)
    t_ok = t < T
    free = t_ok[:, None] & (e < E)[None, :]  # ids not chosen yet
    v = tl.load(s_ptr + t.to(tl.int64)[:, None] * E + e[None, :], mask=free, other=0.0)
    v = tl.where(v != v, float("inf"), v)  # NaN ranks above every score, as in torch.topk
    for k in tl.static_range(K):
        best = tl.max(tl.where(free, v, float("-inf")), axis=1)
        i = tl.min(tl.where(free & (v == best[:, None]), e[None, :], EP), axis=1)  # the lowest free id of the best
        tl.store(idx_ptr + t.to(tl.int64) * K + k, i.to(tl.int64), mask=t_ok)
        free = free & (e[None, :] != i[:, None])


def topk_ids(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """`[T, k]` int64: the ids of each row's k largest scores, largest first (ties: the lower id; NaN largest)."""
    T, E = scores_TE.shape
    if not 1 <= k <= E or scores_TE.dtype != torch.float32:
        raise ValueError(f"topk_ids: k={k} of {E} experts, scores {scores_TE.dtype}")
    out = torch.empty(T, k, dtype=torch.int64, device=scores_TE.device)
    if T:
        ep = triton.next_power_of_2(E)
        block_t = max(16, 2048 // ep)
        _topk_ids_kernel[(triton.cdiv(T, block_t),)](scores_TE.contiguous(), out, T, E, K=k, BLOCK_T=block_t, EP=ep,
                                                      num_warps=4)  # fmt: skip
    return out
