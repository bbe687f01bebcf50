"""The few collectives the buffers and optimizers use, over a `Group`.

Each is a no-op on a one-rank group (`group.pg is None`), which is what lets world size 1 run without
torch.distributed. Async variants return a handle with `wait()`; a no-op returns None. Names follow
torch 2.13 (`reduce_scatter_single`, `all_gather_single`) and fall back to the older `*_tensor` names.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from trainer.distributed.parallel_state import Group

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
