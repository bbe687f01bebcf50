"""The layer-wise buffer layout: shards of whole matrices, balanced by Newton-Schulz FLOPs over the group.

Megatron's "layout path" for its LayerWiseDistributedOptimizer (megatron/core/optimizer/
layer_wise_optimizer.py with `full_param_layout`): the params of each bucket are bin-packed into the
bucket's `shard_group_size` shards by LPT (longest processing time first) on the NS cost
`max(m, n) * min(m, n)^2` per matrix Muon orthogonalises (`cost`: `muon_routing.muon_cost` counts a split
gated fc1 as its gate and up halves), and every shard is padded to one size. Shard r is owned by rank r
of the bucket's group, so the *unchanged* bucket machinery does the layer-wise distribution: the grad
reduce-scatter hands each owner the full reduced grads of its matrices, and the param all-gather of equal
shards ships each owner's updated matrices to every rank (a staging or quantizing `ParamStorage` works
on it unchanged).

Two departures from a per-bucket LPT, both for balance (max rank load / mean, `shard_loads`):
- a batch of matrices (a grouped `[E, m, n]` expert weight) whose E splits evenly over the group is
  *spread*: it gets a bucket of its own whose shards each hold E / group whole expert slices (Muon
  orthogonalises every slice alone, so a slice is as good a unit as a param). Such a weight is the
  bulk of an MoE layer's Newton-Schulz work and often larger than a bucket; kept whole, one rank would
  orthogonalise it while the others wait (on the 8-layer, 32-expert reference model at dp=4 the
  per-bucket plan put 3.8x the mean load on rank 0);
- the LPT of each bucket starts from the loads the earlier buckets left, so the plan is balanced over the
  whole buffer, not bucket by bucket (per bucket, the first and largest param of every bucket went to
  rank 0).

Invariants of a plan (tested):
- buckets are filled in the order given (backward order); a spread param is a bucket alone; the others
  form buckets that close once they hold `bucket_size` elements (or before a spread param), like
  `trainer.distributed.layout.plan_buffer`; a bucket's params are a contiguous run of that order;
- inside a bucket of whole params, shard r holds the params LPT gave to r, in the order given, each
  starting at a multiple of `PARAM_ALIGN`; every shard has the same size, a multiple of `BUCKET_ALIGN`,
  so buckets start aligned and split evenly over the group; a spread param's shard r is its slices
  [r E / group, (r + 1) E / group);
- ownership is a pure function of the params' names and costs (their shapes, and the gate/up row layout
  the model sets on gated fc1 weights): ties in cost are broken by the param's
  name, ties in load by the lower rank, never by object identity or memory address (Megatron's legacy
  path gave ranks different owners on ties, fixed in #5479), so every rank computes the same owners;
- `plan.buckets[k].param_indices` lists the bucket's params in increasing offset (the order `Bucket`
  and the optimizers walk them).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import torch

from moectl.core.arith import round_up
from trainer.distributed.layout import BUCKET_ALIGN, PARAM_ALIGN, BucketPlan, BufferPlan
from trainer.optim.muon import ns_cost

#: a param's Newton-Schulz cost (`muon_routing.muon_cost`: of what Muon orthogonalises, e.g. gate/up halves)
CostFn = Callable[[torch.nn.Parameter], int]


def shape_cost(param: torch.nn.Parameter) -> int:
    """`ns_cost` of the param's own shape (every trailing `[out, in]` matrix whole)."""
    return ns_cost(param.shape)


def lpt_assign(costs: Sequence[int], keys: Sequence[str], bins: int, loads: list[int] | None = None) -> list[int]:
    """The bin of each item: items by decreasing cost (ties: increasing key) go to the least-loaded bin.

    Integer costs, so load comparisons are exact; a tie in load goes to the lower bin index. `loads`: the
    bins' loads so far (updated in place); None starts from empty bins.
    """
    if bins < 1:
        raise ValueError(f"need at least one bin, got {bins}")
    if len(set(keys)) != len(keys):
        raise ValueError("LPT keys must be unique: they are the canonical tie-break")
    if loads is None:
        loads = [0] * bins
    elif len(loads) != bins:
        raise ValueError(f"{len(loads)} starting loads for {bins} bins")
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], keys[i])):
        b = min(range(bins), key=lambda r: (loads[r], r))
        owner[i] = b
        loads[b] += costs[i]
    return owner


def spreads(shape: torch.Size | tuple[int, ...], shard_group_size: int) -> bool:
    """Whether a param of `shape` is spread over the shards (see the module docstring): a batch of matrices
    (3 or more dims) whose matrix count splits evenly over a group of 2+ and whose per-shard part is a
    whole number of `BUCKET_ALIGN` elements."""
    if shard_group_size < 2 or len(shape) < 3:
        return False
    count, per_matrix = math.prod(shape[:-2]), shape[-2] * shape[-1]
    return count % shard_group_size == 0 and (count // shard_group_size * per_matrix) % BUCKET_ALIGN == 0


def plan_layerwise_buffer(params: Sequence[torch.nn.Parameter], names: Mapping[torch.nn.Parameter, str],
                          bucket_size: int, shard_group_size: int, cost: CostFn = shape_cost) -> BufferPlan:
    """Lay out `params` (backward order) into buckets whose shards each hold whole matrices (see module doc)."""
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be positive, got {bucket_size}")
    if shard_group_size < 1:
        raise ValueError(f"shard_group_size must be positive, got {shard_group_size}")
    runs: list[list[int]] = []
    run: list[int] = []
    held = 0
    for i, p in enumerate(params):
        if spreads(p.shape, shard_group_size):
            runs += [run, [i]] if run else [[i]]
            run, held = [], 0
            continue
        run.append(i)
        held += round_up(p.numel(), PARAM_ALIGN)
        if held >= bucket_size:
            runs.append(run)
            run, held = [], 0
    if run:
        runs.append(run)

    ranges: list[tuple[int, int]] = [(0, 0)] * len(params)
    buckets: list[BucketPlan] = []
    loads = [0] * shard_group_size  # NS cost per shard index, carried from bucket to bucket
    start = 0
    for index, members in enumerate(runs):
        if len(members) == 1 and spreads(params[members[0]].shape, shard_group_size):
            i = members[0]
            ranges[i] = (start, start + params[i].numel())
            loads[:] = [load + cost(params[i]) // shard_group_size for load in loads]
            end = start + params[i].numel()
        else:
            end = _place_whole(params, names, members, start, shard_group_size, cost, loads, ranges)
        buckets.append(BucketPlan(index, start, end, tuple(sorted(members, key=lambda i: ranges[i][0]))))
        start = end
    return BufferPlan(tuple(ranges), tuple(buckets), start, shard_group_size)


def _place_whole(params: Sequence[torch.nn.Parameter], names: Mapping[torch.nn.Parameter, str],
                 members: list[int], start: int, shard_group_size: int, cost: CostFn, loads: list[int],
                 ranges: list[tuple[int, int]]) -> int:
    """Place a bucket of whole params at `start` (LPT from `loads`, updated); set their ranges, return its end."""
    owners = lpt_assign([cost(params[i]) for i in members], [names[params[i]] for i in members],
                        shard_group_size, loads)
    placed: dict[int, tuple[int, int]] = {}  # param index -> (shard, offset in shard)
    fill = [0] * shard_group_size
    for i, r in zip(members, owners):  # members keep the order given inside each shard
        off = round_up(fill[r], PARAM_ALIGN)
        placed[i] = (r, off)
        fill[r] = off + params[i].numel()
    shard_size = round_up(max(fill), BUCKET_ALIGN)
    for i, (r, off) in placed.items():
        a = start + r * shard_size + off
        ranges[i] = (a, a + params[i].numel())
    return start + shard_size * shard_group_size


def shard_loads(plan: BufferPlan, params: Sequence[torch.nn.Parameter], cost: CostFn = shape_cost) -> list[int]:
    """The NS cost each shard index (rank of the group) carries over the whole plan: a param's cost goes to
    the shards its elements lie in, in proportion (whole params: all to one; spread ones: equal parts)."""
    loads = [0] * plan.shard_group_size
    for bucket in plan.buckets:
        size = plan.shard_size(bucket)
        for i in bucket.param_indices:
            lo, hi = plan.param_ranges[i]
            numel, c = hi - lo, cost(params[i])
            for r in range((lo - bucket.start) // size, (hi - 1 - bucket.start) // size + 1):
                a, b = max(lo, bucket.start + r * size), min(hi, bucket.start + (r + 1) * size)
                loads[r] += c * (b - a) // numel
    return loads
