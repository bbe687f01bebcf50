"""A bucket: one contiguous slice of a buffer, the unit of reduce-scatter and all-gather.

Invariants: `grad_data` and `param_data` are views of the owning buffer (never copies); the bucket's
numel is a multiple of its group size, and rank r of the group owns the shard
[r * shard_size, (r + 1) * shard_size) (bucket-local element indices). Params may straddle shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from trainer.distributed.layout import BucketPlan

if TYPE_CHECKING:
    from trainer.distributed.buffers import ParamAndGradBuffer


@dataclass(frozen=True)
class Piece:
    """The part of one param that falls in a bucket-local range [lo, hi).

    Elements [param_lo, param_hi) of the flattened param sit at bucket elements [bucket_lo, bucket_hi).
    """

    param: torch.nn.Parameter
    param_lo: int
    param_hi: int
    bucket_lo: int
    bucket_hi: int


class Bucket:
    def __init__(self, buffer: "ParamAndGradBuffer", plan: BucketPlan, params: Sequence[torch.nn.Parameter],
                 param_ranges: dict[torch.nn.Parameter, tuple[int, int]]) -> None:
        self.buffer = buffer
        self.index = plan.index
        self.start = plan.start
        self.end = plan.end
        self.params = tuple(params)
        #: bucket-local (start, end) of each param
        self.param_ranges = {p: (param_ranges[p][0] - self.start, param_ranges[p][1] - self.start) for p in params}
        self.grad_data = buffer.grad_data[self.start:self.end]
        self.param_data = buffer.param_data[self.start:self.end]
        self.group = buffer.group
        if self.numel % self.group.size:
            raise AssertionError(f"bucket of {self.numel} elements does not split over {self.group.size} ranks")
        self.shard_size = self.numel // self.group.size

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, shard_rank: int | None = None) -> tuple[int, int]:
        """Bucket-local [lo, hi) of the shard of `shard_rank` (default: this rank's)."""
        r = self.group.rank if shard_rank is None else shard_rank
        return r * self.shard_size, (r + 1) * self.shard_size

    def pieces(self, lo: int, hi: int) -> list[Piece]:
        """Every param overlapping bucket-local [lo, hi), clipped to it, in bucket order."""
        out = []
        for p in self.params:
            s, e = self.param_ranges[p]
            a, b = max(s, lo), min(e, hi)
            if a < b:
                out.append(Piece(p, a - s, b - s, a, b))
        return out
