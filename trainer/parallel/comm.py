"""The few collectives the buffers and optimizers use, over a `Group`.

Each is a no-op on a one-rank group (`group.pg is None`), which is what lets world size 1 run without
torch.distributed. Async variants return a handle with `wait()`; a no-op returns None. Names follow
torch 2.13 (`reduce_scatter_single`, `all_gather_single`) and fall back to the older `*_tensor` names.

`all_gather_coalesced` issues many all-gathers on one group as ONE collective where the backend can
(torch's `_coalescing_manager`, as Megatron-Core's bucket groups use it: NCCL runs them inside one
ncclGroupStart/End, so a dozen ~100 MB buckets cost about what one call of their total size costs), else
as back-to-back async calls; `coalescing_mode` is the decision, kept separate so tests can take each path.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, Sequence

import torch
import torch.distributed as dist

from trainer.parallel.groups import Group

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
try:  # private in every torch that has it; absent: every gather takes the per-call path
    from torch.distributed.distributed_c10d import _coalescing_manager
except ImportError:  # pragma: no cover - torch without it
    _coalescing_manager = None

#: Backends whose process groups implement the coalesced all-gather fast path that `_coalescing_manager`
#: takes when no device is passed (`all_gather_single_coalesced`), each with whether one coalesced call
#: may mix dtypes. NCCL: yes (one ncclAllGather per tensor, in its own dtype, inside one NCCL group;
#: the 2-GPU test in tests/trainer/distributed/test_dist_coalesced.py checks it). gloo (torch 2.13): a call
#: mixing bf16 and fp32 tensors returned wrong values while one dtype per call is exact, so pairs are
#: coalesced per dtype there. Passing a device to `_coalescing_manager` would switch to start/end
#: coalescing instead, which gloo does not implement.
COALESCING_BACKENDS: dict[str, bool] = {"nccl": True, "gloo": False}


class Handle(Protocol):
    def wait(self) -> Any: ...


def all_reduce(tensor: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               async_op: bool = False) -> Handle | None:
    """In-place all-reduce of `tensor` over `group`."""
    if group.pg is None:
        return None
    return dist.all_reduce(tensor, op=op, group=group.pg, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False) -> Handle | None:
    """Sum `input` (group.size equal shards) over the group; shard `group.rank` lands in `output`.

    `output` may be a view of `input` (its own shard), as the grad buffers use it.
    """
    if group.pg is None:
        if output.data_ptr() != input.data_ptr() or output.numel() != input.numel():
            output.copy_(input)
        return None
    return _reduce_scatter(output, input, group=group.pg, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False) -> Handle | None:
    """Concatenate every rank's `input` into `output`; `input` may be this rank's shard view of `output`."""
    if group.pg is None:
        if output.data_ptr() != input.data_ptr() or output.numel() != input.numel():
            output.copy_(input)
        return None
    return _all_gather(output, input, group=group.pg, async_op=async_op)


def broadcast(tensor: torch.Tensor, group: Group) -> None:
    """Overwrite `tensor` with the values of the group's first rank."""
    if group.pg is None:
        return
    dist.broadcast(tensor, src=group.first_global_rank, group=group.pg)


def all_gather_object(obj: Any, group: Group) -> list[Any]:
    """Every rank's `obj`, in group order (small Python objects only: hashes, flags)."""
    if group.pg is None:
        return [obj]
    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, obj, group=group.pg)
    return out


class CompositeHandle:
    """One handle over several: `wait()` waits each once, in issue order (a second `wait()` is a no-op).

    Several bucket groups share the handle of one coalesced gather; whichever waits first waits for all.
    """

    def __init__(self, handles: Sequence[Any]) -> None:
        self._handles: list[Any] = [h for h in handles if h is not None]

    def wait(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.wait()


Coalescing = Literal["all", "per_dtype", "none"]


def coalescing_mode(group: Group) -> Coalescing:
    """How all-gathers on `group` can be coalesced (see COALESCING_BACKENDS): all in one collective, one
    collective per dtype, or not at all (one call each: a one-rank group, an unknown backend, or a torch
    without `_coalescing_manager`)."""
    if group.pg is None or _coalescing_manager is None:
        return "none"
    mixed = COALESCING_BACKENDS.get(dist.get_backend(group.pg))
    if mixed is None:
        return "none"
    return "all" if mixed else "per_dtype"


def _coalesced(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], pg: Any) -> Any:
    with _coalescing_manager(pg, async_ops=True) as cm:
        for output, input in pairs:
            _all_gather(output, input, group=pg, async_op=True)  # recorded; issued together on exit
    return cm


def all_gather_coalesced(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], group: Group) -> Handle | None:
    """Start the all-gather of every `(output, input)` pair over `group` (async); one handle waits for all.

    Inputs may be this rank's shard views of their outputs, as in `all_gather`. Outputs may differ in dtype
    (uint8 FP8 bytes beside bf16). Per `coalescing_mode`, the gathers are one coalesced collective, one per
    dtype (in order of first appearance, the same on every rank), or issued one by one, back to back.
    Either way every byte lands exactly where the same `all_gather` calls would put it. None on a one-rank
    group (nothing moves) or without pairs.
    """
    if group.pg is None or not pairs:
        for output, input in pairs:
            all_gather(output, input, group)  # the one-rank copy, if input is not already output's shard
        return None
    mode = coalescing_mode(group)
    if mode == "none":
        return CompositeHandle([_all_gather(o, i, group=group.pg, async_op=True) for o, i in pairs])
    if mode == "all":
        return _coalesced(pairs, group.pg)
    by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for pair in pairs:
        by_dtype.setdefault(pair[0].dtype, []).append(pair)
    return CompositeHandle([_coalesced(same, group.pg) for same in by_dtype.values()])
