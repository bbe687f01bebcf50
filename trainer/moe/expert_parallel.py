"""Which experts a rank holds and which dispatcher reaches them: the one seam `MoELayer` calls.

With an expert-parallel group of ep > 1 ranks, the E experts of a layer are sharded contiguously: ep rank
r holds global experts [r*E/ep, (r+1)*E/ep). `GroupedMLP` builds exactly those (as the matching slice of
the same one-draw `[E, out, in]` init as the ep=1 model), and the dispatcher moves each routing to its
owner (`moe.token_dispatcher`: `alltoall`, the default, or `allgather`). The router and every dense layer
stay replicated. Without a group, or with a one-rank group, nothing changes: `LocalDispatcher`, all experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

from moectl.core.config.schema import MoEConfig
from trainer.moe.dispatch import LocalDispatcher
from trainer.moe.dispatch_allgather import AllGatherDispatcher
from trainer.moe.dispatch_alltoall import AllToAllDispatcher, check_divisible

if TYPE_CHECKING:
    from trainer.parallel.groups import Group

Dispatcher = Union[LocalDispatcher, AllToAllDispatcher, AllGatherDispatcher]


def _ep(ep_group: Optional["Group"]) -> int:
    return 1 if ep_group is None else ep_group.size


def expert_shard(cfg: MoEConfig, ep_group: Optional["Group"]) -> dict[str, int]:
    """`GroupedMLP` kwargs for this rank's experts: `num_local_experts` (E/ep) and `first_expert` (global id)."""
    ep = _ep(ep_group)
    check_divisible(cfg.num_experts, ep)
    local = cfg.num_experts // ep
    rank = ep_group.rank if ep_group is not None and ep > 1 else 0
    return {"num_local_experts": local, "first_expert": rank * local}


def build_dispatcher(cfg: MoEConfig, *, align: int, ep_group: Optional["Group"]) -> Dispatcher:
    """The dispatcher of one MoE layer: local for ep <= 1, else `cfg.token_dispatcher` over `ep_group`."""
    common = dict(align=align, capacity_factor=cfg.capacity_factor, pad_to_capacity=cfg.pad_expert_input_to_capacity)
    if _ep(ep_group) == 1:
        return LocalDispatcher(cfg.num_experts, **common)  # type: ignore[arg-type]
    if cfg.token_dispatcher == "allgather":
        return AllGatherDispatcher(cfg.num_experts, ep_group, **common)  # type: ignore[arg-type]
    return AllToAllDispatcher(cfg.num_experts, ep_group, chunks=cfg.ep_overlap_chunks, **common)  # type: ignore[arg-type]
