"""Where each param and each bucket lives in a contiguous buffer: pure arithmetic, no tensors.

A *run* is a sequence of consecutive params that stand for one logical tensor: the per-expert params
`weight0..weight{E-1}` of an expert linear, in expert order, stand for its grouped `[E, out, in]` weight
(`GroupedLinearParams.param_runs`). A run is laid out exactly as that one tensor would be, so the grad
buffers of the two expert layouts are equal element for element, and so is every sum over them (the grad
norm adds fixed-size rows of the buffer in order).

Invariants of a plan (tested directly):
- params appear in the order given (the caller passes backward order: reverse registration, a run's
  members in its own order at the place of its first member in that order), never overlapping, never
  split across buckets;
- a param starts at a multiple of `PARAM_ALIGN` elements unless it continues a run: then it starts
  where the run's previous member ends (no padding inside a run; the run's first member is aligned);
- buckets tile the buffer: bucket k ends where bucket k+1 starts, the last ends at `total`;
- a bucket closes at the end of the first param that brings it to at least `bucket_size` elements and
  ends no run there (a run is never split across buckets), and its end is padded to a multiple of
  lcm(shard_group_size, 128), so it splits into `shard_group_size` equal shards (one per rank of the
  reduce-scatter / all-gather group) and every bucket start stays aligned;
- padding elements belong to no param; their grads and masters stay zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

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


#: per param, the name of the run it belongs to (the one tensor the run stands for, e.g. the grouped weight's
#: qualified name), or None (no run)
Runs = Sequence[Optional[str]]


def continues_run(runs: Optional[Runs], n: int) -> list[bool]:
    """Per param of `n`, whether it continues the run of the param before it (see the module docstring).

    Raises ValueError where `runs` does not match `n` params or a run's members are not consecutive.
    """
    if runs is None:
        return [False] * n
    if len(runs) != n:
        raise ValueError(f"{len(runs)} run names for {n} params")
    glued: list[bool] = []
    closed: set[str] = set()
    for i, run in enumerate(runs):
        glued.append(i > 0 and run is not None and runs[i - 1] == run)
        if run is not None and not glued[-1]:
            if run in closed:
                raise ValueError(f"the members of run {run!r} are not consecutive")
            closed.add(run)
    return glued


def plan_buffer(numels: Sequence[int], bucket_size: int, shard_group_size: int,
                runs: Optional[Runs] = None) -> BufferPlan:
    """Lay out params of `numels` (already in backward order) into padded buckets; `runs`: per param its run's
    name or None (see `Runs`; None: no runs)."""
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

    glued = continues_run(runs, len(numels))
    for i, n in enumerate(numels):
        if n < 1:
            raise ValueError(f"param {i} has no elements")
        start = offset if glued[i] else round_up(offset, PARAM_ALIGN)
        ranges.append((start, start + n))
        members.append(i)
        offset = start + n
        run_goes_on = i + 1 < len(numels) and glued[i + 1]
        if offset - bucket_start >= bucket_size and not run_goes_on:
            close()
    if members:
        close()
    return BufferPlan(tuple(ranges), tuple(buckets), offset if not buckets else buckets[-1].end, shard_group_size)
