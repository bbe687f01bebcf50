"""Narrow sort keys: ids sorted by a radix sort (`torch.sort`, `torch.argsort` on CUDA) cost one pass per byte
of their dtype, so ids with a small bound are sorted as uint8 or int16. Used by the MoE dispatchers (expert
ids) and the embedding's grad (token ids)."""

from __future__ import annotations

import torch


def compact_ids(ids: torch.Tensor, bound: int) -> torch.Tensor:
    """Ids in `[0, bound]` in the narrowest integer dtype that holds `bound` (uint8, int16, else int32).

    A sort of them orders exactly as one of the int64 ids (stable: the same permutation), but the radix sort
    behind `torch.sort` on CUDA makes one pass per byte of its key: 8 for int64, 1 for uint8."""
    dtype = torch.uint8 if bound <= 255 else torch.int16 if bound <= 32767 else torch.int32
    return ids.to(dtype)
