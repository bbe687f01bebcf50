"""The layer-wise buffer layout: every shard of a bucket holds whole params, balanced by Newton-Schulz cost.

Megatron's "layout path" for its LayerWiseDistributedOptimizer (megatron/core/optimizer/
layer_wise_optimizer.py with `full_param_layout`): the params of each bucket are bin-packed into the
bucket's `shard_group_size` shards by LPT (longest processing time first) on the NS cost
`max(m, n) * min(m, n)^2`, no param crosses a shard, and every shard is padded to one size. Shard r is
owned by rank r of the bucket's group, so the *unchanged* bucket machinery does the layer-wise
distribution: the grad reduce-scatter hands each owner the full reduced grads of its matrices, and the
param all-gather of equal shards ships each owner's whole updated matrices to every rank (a staging or
quantizing `ParamStorage` works on it unchanged).

Invariants of a plan (tested):
- buckets are filled in the order given (backward order), closing once they hold `bucket_size` elements,
  exactly like `trainer.distributed.layout.plan_buffer`; a bucket's params are a contiguous run of that order;
- inside a bucket, shard r holds the params LPT gave to r, in the order given, each starting at a
  multiple of `PARAM_ALIGN`; every shard has the same size, a multiple of `BUCKET_ALIGN`, so buckets
  start aligned and split evenly over the group;
- ownership is a pure function of the params' names and shapes: ties in cost are broken by the param's
  name, ties in load by the lower rank, never by object identity or memory address (Megatron's legacy
  path gave ranks different owners on ties, fixed in #5479), so every rank computes the same owners;
- `plan.buckets[k].param_indices` lists the bucket's params in increasing offset (the order `Bucket`
  and the optimizers walk them).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from trainer.distributed.layout import BUCKET_ALIGN, PARAM_ALIGN, BucketPlan, BufferPlan, pad_to
from trainer.optim.muon import ns_cost

CostFn = Callable[[torch.Size], int]


def lpt_assign(costs: Sequence[int], keys: Sequence[str], bins: int) -> list[int]:
    """The bin of each item: items by decreasing cost (ties: increasing key) go to the least-loaded bin.

    Integer costs, so load comparisons are exact; a tie in load goes to the lower bin index.
    """
    if bins < 1:
        raise ValueError(f"need at least one bin, got {bins}")
    if len(set(keys)) != len(keys):
        raise ValueError("LPT keys must be unique: they are the canonical tie-break")
    loads = [0] * bins
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], keys[i])):
        b = min(range(bins), key=lambda r: (loads[r], r))
        owner[i] = b
        loads[b] += costs[i]
    return owner


def plan_layerwise_buffer(params: Sequence[torch.nn.Parameter], names: Mapping[torch.nn.Parameter, str],
                          bucket_size: int, shard_group_size: int, cost: CostFn = ns_cost) -> BufferPlan:
    """Lay out `params` (backward order) into buckets whose shards each hold whole params (see module doc)."""
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be positive, got {bucket_size}")
    if shard_group_size < 1:
        raise ValueError(f"shard_group_size must be positive, got {shard_group_size}")
    runs: list[list[int]] = []
    run: list[int] = []
    held = 0
    for i, p in enumerate(params):
        run.append(i)
        held += pad_to(p.numel(), PARAM_ALIGN)
        if held >= bucket_size:
            runs.append(run)
            run, held = [], 0
    if run:
        runs.append(run)

    ranges: list[tuple[int, int]] = [(0, 0)] * len(params)
    buckets: list[BucketPlan] = []
    start = 0
    for index, members in enumerate(runs):
        owners = lpt_assign([cost(params[i].shape) for i in members], [names[params[i]] for i in members],
                            shard_group_size)
        placed: dict[int, tuple[int, int]] = {}  # param index -> (shard, offset in shard)
        fill = [0] * shard_group_size
        for i, r in zip(members, owners):  # members keep the order given inside each shard
            off = pad_to(fill[r], PARAM_ALIGN)
            placed[i] = (r, off)
            fill[r] = off + params[i].numel()
        shard_size = pad_to(max(fill), BUCKET_ALIGN)
        for i, (r, off) in placed.items():
            a = start + r * shard_size + off
            ranges[i] = (a, a + params[i].numel())
        end = start + shard_size * shard_group_size
        buckets.append(BucketPlan(index, start, end, tuple(sorted(members, key=lambda i: ranges[i][0]))))
        start = end
    return BufferPlan(tuple(ranges), tuple(buckets), start, shard_group_size)
