"""Where each param and each bucket lives in a contiguous buffer: pure arithmetic, no tensors.

Invariants of a plan (tested directly):
- params appear in the order given (the caller passes backward order = reverse registration), each
  starting at a multiple of `PARAM_ALIGN` elements, never overlapping, never split across buckets;
- buckets tile the buffer: bucket k ends where bucket k+1 starts, the last ends at `total`;
- a bucket closes once it holds at least `bucket_size` elements, and its end is padded to a multiple of
  lcm(shard_group_size, 128), so it splits into `shard_group_size` equal shards (one per rank of the
  reduce-scatter / all-gather group) and every bucket start stays aligned;
- padding elements belong to no param; their grads and masters stay zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from moectl.core.arith import round_up

PARAM_ALIGN = 64
BUCKET_ALIGN = 128
DEFAULT_BUCKET_SIZE = 40_000_000


def default_bucket_size(dp_size: int) -> int:
    """Megatron's default: max(40M, 1M * dp) elements, so each rank's shard is never tiny."""
    return max(DEFAULT_BUCKET_SIZE, 1_000_000 * dp_size)


def bucket_divisor(shard_group_size: int) -> int:
    return math.lcm(shard_group_size, BUCKET_ALIGN)


@dataclass(frozen=True)
class BucketPlan:
    """A bucket: elements [start, end) of the buffer, holding params `param_indices` (plan order)."""

    index: int
    start: int
    end: int
    param_indices: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BufferPlan:
    """Element ranges of every param (`param_ranges[i] = (start, end)`) and every bucket, and the total."""

    param_ranges: tuple[tuple[int, int], ...]
    buckets: tuple[BucketPlan, ...]
    total: int
    shard_group_size: int

    def shard_size(self, bucket: BucketPlan) -> int:
        return bucket.numel // self.shard_group_size


def plan_buffer(numels: Sequence[int], bucket_size: int, shard_group_size: int) -> BufferPlan:
    """Lay out params of `numels` (already in backward order) into padded buckets."""
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be positive, got {bucket_size}")
    if shard_group_size < 1:
        raise ValueError(f"shard_group_size must be positive, got {shard_group_size}")
    divisor = bucket_divisor(shard_group_size)
    ranges: list[tuple[int, int]] = []
    buckets: list[BucketPlan] = []
    bucket_start = 0
    offset = 0
    members: list[int] = []

    def close() -> None:
        nonlocal bucket_start, offset, members
        end = round_up(offset, divisor)
        buckets.append(BucketPlan(len(buckets), bucket_start, end, tuple(members)))
        bucket_start = offset = end
        members = []

    for i, n in enumerate(numels):
        if n < 1:
            raise ValueError(f"param {i} has no elements")
        start = round_up(offset, PARAM_ALIGN)
        ranges.append((start, start + n))
        members.append(i)
        offset = start + n
        if offset - bucket_start >= bucket_size:
            close()
    if members:
        close()
    return BufferPlan(tuple(ranges), tuple(buckets), offset if not buckets else buckets[-1].end, shard_group_size)
