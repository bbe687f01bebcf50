"""Triton kernels: the stable sort of routings by expert, as a counting sort, and its inverse permutation.

The dispatch orders the N = T*K routings by expert id (stable, so each expert's rows keep token order) and
needs the inverse (the row each routing went to). `torch.argsort(stable=True)` on CUDA is a radix sort of
four to six launches plus memsets, and the inverse an `index_put`: ~35 us and a dozen launches per layer and
micro-batch at the reference shape. Keys here are small (`[0, B)`, B = E or E + 1 with the dropped bucket), so
a counting sort does it in three launches:

    _block_hist     program b counts the keys of its block of routings per bucket      -> hist[b, B]
    _block_starts   one program: each block's first row per bucket, a running prefix    -> start[b, B]
                    over blocks added to the exclusive prefix of the bucket totals
    _block_scatter  program b ranks its keys within the block (a cumsum of the one-hot
                    tile along the block), `pos = start[b, key] + rank`, and stores
                    `order[pos] = n` and `inverse[n] = pos`

The result is a permutation, so it equals `torch.argsort(keys, stable=True)` exactly (tested on the GPU).
Imported lazily on CUDA only; importing it needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TILE = 8192  # one-hot elements per program tile: BLOCK routings x the buckets rounded up to a power of two


@triton.jit
def _block_hist(keys_ptr, hist_ptr, N, B, BLOCK: tl.constexpr, BP: tl.constexpr):
    b = tl.program_id(0)
    n = b * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < N
    key = tl.load(keys_ptr + n, mask=n_ok, other=0).to(tl.int32)
    e = tl.arange(0, BP)
    hit = ((key[:, None] == e[None, :]) & n_ok[:, None]).to(tl.int32)  # [BLOCK, BP]; no sentinel key: any
    # value is a bucket in a narrow dtype (uint8 holds 255)
    tl.store(hist_ptr + b * B + e, tl.sum(hit, axis=0), mask=e < B)


@triton.jit
def _block_starts(hist_ptr, start_ptr, NB, B, CH: tl.constexpr, BP: tl.constexpr):
    e = tl.arange(0, BP)
    e_ok = e < B
    total = tl.zeros((BP,), dtype=tl.int32)
    for i in range(tl.cdiv(NB, CH)):  # bucket totals first: they set where each bucket starts
        b = i * CH + tl.arange(0, CH)
        ok = (b < NB)[:, None] & e_ok[None, :]
        total += tl.sum(tl.load(hist_ptr + b[:, None] * B + e[None, :], mask=ok, other=0), axis=0)
    carry = tl.cumsum(total, axis=0) - total  # [BP]: the first row of each bucket
    for i in range(tl.cdiv(NB, CH)):
        b = i * CH + tl.arange(0, CH)
        ok = (b < NB)[:, None] & e_ok[None, :]
        h = tl.load(hist_ptr + b[:, None] * B + e[None, :], mask=ok, other=0)
        tl.store(start_ptr + b[:, None] * B + e[None, :], carry[None, :] + tl.cumsum(h, axis=0) - h, mask=ok)
        carry += tl.sum(h, axis=0)


@triton.jit
def _block_scatter(keys_ptr, start_ptr, order_ptr, inverse_ptr, N, B, BLOCK: tl.constexpr, BP: tl.constexpr):
    b = tl.program_id(0)
    n = b * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < N
    key = tl.load(keys_ptr + n, mask=n_ok, other=0).to(tl.int32)
    e = tl.arange(0, BP)
    hit = ((key[:, None] == e[None, :]) & n_ok[:, None]).to(tl.int32)  # [BLOCK, BP]; a masked row hits nothing
    start = tl.load(start_ptr + b * B + e, mask=e < B, other=0)
    before = tl.cumsum(hit, axis=0) - hit  # earlier keys of the same bucket in this block
    pos = tl.sum(hit * (before + start[None, :]), axis=1)  # [BLOCK]
    tl.store(order_ptr + pos, n.to(order_ptr.dtype.element_ty), mask=n_ok)
    tl.store(inverse_ptr + n, pos.to(inverse_ptr.dtype.element_ty), mask=n_ok)


def counting_sort(keys_N: torch.Tensor, buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(order_N, inverse_N)` (int64): `order` equals `torch.argsort(keys_N, stable=True)` for keys in
    `[0, buckets)`, and `inverse[order[r]] = r`. A key outside that range is a caller's bug (not checked: a
    check would read the keys on the host)."""
    if keys_N.dim() != 1 or not keys_N.is_cuda or buckets < 1:
        raise ValueError(f"counting_sort: keys {tuple(keys_N.shape)} on {keys_N.device}, buckets={buckets}")
    N = keys_N.numel()
    order = torch.empty(N, dtype=torch.int64, device=keys_N.device)
    inverse = torch.empty_like(order)
    if N == 0:
        return order, inverse
    bp = triton.next_power_of_2(buckets)
    block = max(16, _TILE // bp)
    nb = triton.cdiv(N, block)
    keys = keys_N.contiguous()
    hist = torch.empty(nb, buckets, dtype=torch.int32, device=keys.device)
    start = torch.empty_like(hist)
    _block_hist[(nb,)](keys, hist, N, buckets, BLOCK=block, BP=bp, num_warps=4)
    _block_starts[(1,)](hist, start, nb, buckets, CH=max(1, _TILE // bp), BP=bp, num_warps=4)
    _block_scatter[(nb,)](keys, start, order, inverse, N, buckets, BLOCK=block, BP=bp, num_warps=4)
    return order, inverse
