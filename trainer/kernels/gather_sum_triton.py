"""Triton kernel: each output row the sum of K gathered input rows, `out[t] = sum_k src[index[t*K + k]]`.

The combine of routed expert outputs (and the backward of the dispatch) as autograd ops is a gather into a
`[T*K, D]` tensor and a K-way sum that reads it back (`trainer/moe/permute.py`): the intermediate is written
and read once more than the data needs, about a third of the bytes. Here one program owns a tile of output
rows and columns, reads its K source rows and sums them in fp32 in the order k = 0..K-1, and rounds once to
the output dtype, as torch's `sum(dim=1)` of the gathered `[T, K, D]` does. An index equal to the source's
row count reads zeros (a dropped routing; `permute.py` appends a zero row for that on the torch path).

Imported lazily on CUDA only; importing it needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_sum_kernel(src_ptr, idx_ptr, out_ptr, T, D, rows, stride_src, stride_out, K: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok, d_ok = t < T, d < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):
        r = tl.load(idx_ptr + t.to(tl.int64) * K + k, mask=t_ok, other=rows).to(tl.int64)
        ok = (r < rows)[:, None] & d_ok[None, :]
        acc += tl.load(src_ptr + r[:, None] * stride_src + d[None, :], mask=ok, other=0.0).to(tl.float32)
    out = out_ptr + t.to(tl.int64)[:, None] * stride_out + d[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])


def gather_sum(src_XD: torch.Tensor, index_N: torch.Tensor, topk: int) -> torch.Tensor:
    """`[N / K, D]`: row t the fp32 sum of `src_XD[index_N[t*K + k]]` over k (index X: a zero row), rounded once."""
    if src_XD.dim() != 2 or src_XD.stride(1) != 1 or index_N.dim() != 1 or index_N.numel() % topk:
        raise ValueError(
            f"gather_sum: src {tuple(src_XD.shape)} (row-major 2-D), index {tuple(index_N.shape)}, K={topk}"
        )
    T, D = index_N.numel() // topk, src_XD.shape[1]
    out = torch.empty(T, D, dtype=src_XD.dtype, device=src_XD.device)
    if T == 0 or D == 0:
        return out
    block_d = min(256, triton.next_power_of_2(D))
    grid = (triton.cdiv(T, 16), triton.cdiv(D, block_d))
    _gather_sum_kernel[grid](src_XD, index_N.contiguous(), out, T, D, src_XD.shape[0], src_XD.stride(0), out.stride(0),
                             K=topk, BLOCK_T=16, BLOCK_D=block_d, num_warps=4)  # fmt: skip
    return out
