"""The stable order of routings by expert, the permutation a dispatcher applies, and its inverse.

Shape suffixes: N routings, R routings in sorted order.

On CUDA with Triton the sort is a counting sort in three launches (`kernels/counting_sort_triton.py`, which
also writes the inverse); elsewhere, or with `MOECTL_TRITON_SORT=0`, a radix `torch.argsort` of narrow keys
and an `index_put` for the inverse. Both give the same permutation: it is unique for a stable sort.
"""

from __future__ import annotations

import torch

from trainer.kernels import triton_runs
from trainer.sort_keys import compact_ids


def sort_by_expert(keys_N: torch.Tensor, buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(order_R, inverse_N)` (int64) for keys in `[0, buckets)`: `order_R` is `argsort(keys_N, stable=True)`
    (equal keys keep their order) and `inverse_N[order_R[r]] = r`, the sorted place of each routing."""
    if triton_runs(keys_N.device, "MOECTL_TRITON_SORT"):
        from trainer.kernels.counting_sort_triton import counting_sort

        return counting_sort(keys_N, buckets)
    order_R = torch.argsort(compact_ids(keys_N, buckets - 1), stable=True)
    arange_R = torch.arange(order_R.numel(), device=order_R.device)
    return order_R, torch.empty_like(order_R).index_put_((order_R,), arange_R)
