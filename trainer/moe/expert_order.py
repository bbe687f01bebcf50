"""The stable order of routings by expert, the permutation a dispatcher applies, and its inverse.

Shape suffixes: N routings, R routings in sorted order.

On CUDA with Triton the sort is a counting sort in three launches (`kernels/counting_sort_triton.py`, which
also writes the inverse); elsewhere, or with `MOECTL_TRITON_SORT=0`, a radix `torch.argsort` of narrow keys
and an `index_put` for the inverse. Both give the same permutation: it is unique for a stable sort.
"""

from __future__ import annotations

import torch

from trainer.kernels import triton_runs


def compact_ids(ids: torch.Tensor, bound: int) -> torch.Tensor:
    """Ids in `[0, bound]` in the narrowest integer dtype that holds `bound` (uint8, int16, else int32).

    A sort of them orders exactly as one of the int64 ids (stable: the same permutation), but the radix sort
    behind `torch.sort` on CUDA makes one pass per byte of its key: 8 for int64, 1 for uint8."""
    dtype = torch.uint8 if bound <= 255 else torch.int16 if bound <= 32767 else torch.int32
    return ids.to(dtype)


def sort_by_expert(keys_N: torch.Tensor, buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(order_R, inverse_N)` (int64) for keys in `[0, buckets)`: `order_R` is `argsort(keys_N, stable=True)`
    (equal keys keep their order) and `inverse_N[order_R[r]] = r`, the sorted place of each routing."""
    if triton_runs(keys_N.device, "MOECTL_TRITON_SORT"):
        from trainer.kernels.counting_sort_triton import counting_sort

        return counting_sort(keys_N, buckets)
    order_R = torch.argsort(compact_ids(keys_N, buckets - 1), stable=True)
    arange_R = torch.arange(order_R.numel(), device=order_R.device)
    return order_R, torch.empty_like(order_R).index_put_((order_R,), arange_R)
