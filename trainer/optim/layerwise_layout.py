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

A run of per-expert weights (`trainer.distributed.layout`: `weight0..weight{E-1}` standing for one grouped
`[E, out, in]` weight) that spreads as that grouped weight would is planned as it, a unit: its experts back
to back where its slices would lie, so both expert layouts get the same owners and the same buffer positions,
element for element (and bitwise equal grad norms). On one shard (dp=1) every run is a unit too. A run that
does not spread over 2+ shards is placed member by member, each expert matrix a whole param of its own, as
before runs existed: kept whole, the grouped weight lands on one rank, and on the layer-wise buffer that
padded every shard to its size (E=8 experts at expert-dp 16: 10.7x the params' elements, against 2.3x placed
per expert) and loaded that rank alone. There the layouts' owners differ, and so can the grad norm's last
bit.

Invariants of a plan (tested):
- buckets are filled in the order given (backward order); a spread param (or run) is a bucket alone; the
  others form buckets that close once they hold `bucket_size` elements (or before a spread param), like
  `trainer.distributed.layout.plan_buffer`, never inside a run; a bucket's params are a contiguous part of
  that order;
- inside a bucket of whole params, shard r holds the params (and runs) LPT gave to r, in the order given,
  each param or run starting at a multiple of `PARAM_ALIGN`, a run's members back to back; every shard
  has the same size, a multiple of `BUCKET_ALIGN`, so buckets start aligned and split evenly over the
  group; a spread param's shard r is its slices [r E / group, (r + 1) E / group) (a spread run's: its
  members [r E / group, (r + 1) E / group), back to back);
- ownership is a pure function of the params' names and costs (their shapes, and the gate/up row layout
  the model sets on gated fc1 weights): ties in cost are broken by the param's (or run's)
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
from trainer.distributed.layout import BUCKET_ALIGN, PARAM_ALIGN, BucketPlan, BufferPlan, Runs, continues_run
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


def _units(params: Sequence[torch.nn.Parameter], runs: Runs | None) -> list[list[int]]:
    """The params in order, a run (`trainer.distributed.layout`) as one unit: the one tensor it stands for."""
    glued = continues_run(runs, len(params))
    units: list[list[int]] = []
    for i in range(len(params)):
        if glued[i]:
            units[-1].append(i)
        else:
            units.append([i])
    return units


def _members_of_whole_runs(units: list[list[int]], run_of: list[str | None], spread: list[bool]
                           ) -> tuple[list[list[int]], list[str | None], list[bool]]:
    """Each run that does not spread split into units of one member each (no longer a run)."""
    out: tuple[list[list[int]], list[str | None], list[bool]] = ([], [], [])
    for unit, run, sp in zip(units, run_of, spread):
        pieces = [unit] if run is None or sp else [[i] for i in unit]
        for piece in pieces:
            out[0].append(piece)
            out[1].append(run if len(pieces) == 1 else None)
            out[2].append(sp)
    return out


def _unit_shape(params: Sequence[torch.nn.Parameter], unit: list[int], in_run: bool) -> tuple[int, ...]:
    """The shape of the one tensor a unit stands for: a param's own; a run of equal `[out, in]` matrices (per-expert
    weights) `[n, out, in]`, as its grouped weight; any other run `(numel,)`, which never spreads."""
    first = tuple(params[unit[0]].shape)
    if not in_run:
        return first
    if len(first) == 2 and all(tuple(params[i].shape) == first for i in unit):
        return (len(unit), *first)
    return (sum(params[i].numel() for i in unit),)


def plan_layerwise_buffer(params: Sequence[torch.nn.Parameter], names: Mapping[torch.nn.Parameter, str],
                          bucket_size: int, shard_group_size: int, runs: Runs | None = None,
                          cost: CostFn = shape_cost) -> BufferPlan:
    """Lay out `params` (backward order) into buckets whose shards each hold whole matrices (see module doc).

    `runs` (`trainer.distributed.layout.Runs`): per param its run's name or None. A run of per-expert weights
    that spreads is planned as the grouped weight it stands for, member by member where that weight's slices
    would lie; so is every run on one shard (whole, back to back), its cost its members' (Newton-Schulz cost is
    per matrix, so that is the grouped weight's) and its LPT key the run's name (the grouped weight's). A run
    that does not spread over 2+ shards is placed member by member, as params of their own (module docstring).
    """
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be positive, got {bucket_size}")
    if shard_group_size < 1:
        raise ValueError(f"shard_group_size must be positive, got {shard_group_size}")
    units = _units(params, runs)
    run_of = [None if runs is None else runs[u[0]] for u in units]
    spread = [spreads(_unit_shape(params, u, r is not None), shard_group_size) for u, r in zip(units, run_of)]
    if shard_group_size > 1:  # a run that does not spread is placed member by member (the module docstring)
        units, run_of, spread = _members_of_whole_runs(units, run_of, spread)
    keys = [names[params[u[0]]] if r is None else r for u, r in zip(units, run_of)]
    bucket_units: list[list[int]] = []  # unit indices of each bucket
    members: list[int] = []
    held = 0
    for k, unit in enumerate(units):
        if spread[k]:
            bucket_units += [members, [k]] if members else [[k]]
            members, held = [], 0
            continue
        members.append(k)
        held += round_up(sum(params[i].numel() for i in unit), PARAM_ALIGN)
        if held >= bucket_size:
            bucket_units.append(members)
            members, held = [], 0
    if members:
        bucket_units.append(members)

    ranges: list[tuple[int, int]] = [(0, 0)] * len(params)
    buckets: list[BucketPlan] = []
    loads = [0] * shard_group_size  # NS cost per shard index, carried from bucket to bucket
    start = 0
    for index, ks in enumerate(bucket_units):
        if len(ks) == 1 and spread[ks[0]]:
            unit = units[ks[0]]
            end = _lay_back_to_back(params, unit, start, ranges)
            unit_cost = sum(cost(params[i]) for i in unit)
            loads[:] = [load + unit_cost // shard_group_size for load in loads]
        else:
            end = _place_whole(params, [units[k] for k in ks], [keys[k] for k in ks], start, shard_group_size,
                               cost, loads, ranges)
        bucket = [i for k in ks for i in units[k]]
        buckets.append(BucketPlan(index, start, end, tuple(sorted(bucket, key=lambda i: ranges[i][0]))))
        start = end
    return BufferPlan(tuple(ranges), tuple(buckets), start, shard_group_size)


def _lay_back_to_back(params: Sequence[torch.nn.Parameter], unit: list[int], at: int,
                      ranges: list[tuple[int, int]]) -> int:
    """Set the ranges of a unit's params, back to back from element `at`; return the end."""
    for i in unit:
        ranges[i] = (at, at + params[i].numel())
        at += params[i].numel()
    return at


def _place_whole(params: Sequence[torch.nn.Parameter], units: list[list[int]], keys: list[str], start: int,
                 shard_group_size: int, cost: CostFn, loads: list[int], ranges: list[tuple[int, int]]) -> int:
    """Place a bucket of whole units (a param, or a run of them back to back) at `start` (LPT by `keys` from
    `loads`, updated); set their params' ranges, return the bucket's end."""
    owners = lpt_assign([sum(cost(params[i]) for i in u) for u in units], keys, shard_group_size, loads)
    placed: list[tuple[list[int], int, int]] = []  # (unit, shard, offset in shard)
    fill = [0] * shard_group_size
    for unit, r in zip(units, owners):  # units keep the order given inside each shard
        off = round_up(fill[r], PARAM_ALIGN)
        placed.append((unit, r, off))
        fill[r] = off + sum(params[i].numel() for i in unit)
    shard_size = round_up(max(fill), BUCKET_ALIGN)
    for unit, r, off in placed:
        _lay_back_to_back(params, unit, start + r * shard_size + off, ranges)
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
