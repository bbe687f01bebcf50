"""Process groups (dp, ep, expert-dp) and per-rank seeds.

There is no tensor or pipeline parallelism yet, so the data-parallel group is the whole world and every
rank reads its own micro-batches. Expert parallelism splits the world into blocks of `ep` consecutive
ranks (one block = one full set of experts); the ranks that hold the same experts (same ep rank, one per
block) form the expert-data-parallel group, over which expert grads are reduced and expert masters are
sharded. Invariants:

- `dp.size == world_size`, `ep.size * expert_dp.size == world_size`, and a rank's ep rank is
  `rank % ep`, its expert-dp rank is `rank // ep`.
- A `Group` of one rank has `pg = None`: no collective is ever issued on it (so world size 1 needs no
  `torch.distributed` at all).
- Every rank creates every process group, in the same order (a `new_group` requirement).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moectl.core.errors import ConfigError

if TYPE_CHECKING:
    from moectl.core.config.schema import ParallelConfig

DEFAULT_TIMEOUT_S = 600.0  # parallel.distributed_timeout_minutes' default, for callers without a config
# Expert params must differ across ep ranks (each holds different experts), and agree across expert-dp
# replicas. Megatron offsets its expert RNG the same way (seed + fixed offset + per-ep-rank stride).
EXPERT_SEED_OFFSET = 1024
EXPERT_SEED_STRIDE = 100


@dataclass(frozen=True)
class Group:
    """A set of global ranks that communicate together.

    `rank` is this process's index inside `ranks`; `pg` is None exactly when the group has one rank.
    """

    ranks: tuple[int, ...]
    rank: int
    pg: dist.ProcessGroup | None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def first_global_rank(self) -> int:
        """The global rank of index 0 in this group (the source of broadcasts)."""
        return self.ranks[0]

    @staticmethod
    def single(global_rank: int) -> "Group":
        return Group(ranks=(global_rank,), rank=0, pg=None)


@dataclass(frozen=True)
class ParallelState:
    """Who this process is and which groups it belongs to."""

    world_size: int
    rank: int
    local_rank: int
    dp: Group
    ep: Group
    expert_dp: Group
    backend: str | None  # None when torch.distributed is not in use (world size 1)
    device: torch.device

    @property
    def ep_rank(self) -> int:
        return self.ep.rank

    @property
    def dp_rank(self) -> int:
        return self.dp.rank

    @staticmethod
    def trivial(device: torch.device | str | None = None) -> "ParallelState":
        """World size 1 without torch.distributed: every group is this rank alone."""
        dev = torch.device(device) if device is not None else _default_device(0)
        one = Group.single(0)
        return ParallelState(1, 0, 0, one, one, one, None, dev)

    def group_for(self, is_expert: bool) -> Group:
        """The group a param's grads are reduced (and its masters sharded) over."""
        return self.expert_dp if is_expert else self.dp


def _default_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def ep_sizes(world_size: int) -> list[int]:
    """The expert-parallel sizes a world of `world_size` processes takes: its divisors."""
    return [d for d in range(1, world_size + 1) if world_size % d == 0]


def check_ep_size(world_size: int, ep: int) -> None:
    """Refuse an expert-parallel size that does not divide the world (a user error)."""
    if ep not in ep_sizes(world_size):
        raise ConfigError(
            "parallel.expert_model_parallel_size",
            ep,
            f"must be a positive divisor of the world size ({world_size})",
            fix=f"choose one of {ep_sizes(world_size)}",
        )


def build_parallel_state(ep: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelState:
    """Build dp/ep/expert-dp groups over an already initialized default process group (collective)."""
    if not dist.is_initialized():
        check_ep_size(1, ep)
        return ParallelState.trivial()
    world = dist.get_world_size()
    rank = dist.get_rank()
    check_ep_size(world, ep)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)

    def make(sets: list[tuple[int, ...]], own_communicator: bool = False) -> Group:
        mine: Group | None = None
        for ranks in sets:  # every rank walks every set in the same order
            if len(ranks) == 1:
                pg = None
            elif len(ranks) == world and not own_communicator:
                pg = dist.group.WORLD
            else:
                pg = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                mine = Group(ranks=ranks, rank=ranks.index(rank), pg=pg)
        assert mine is not None
        return mine

    dp = Group(ranks=tuple(range(world)), rank=rank, pg=dist.group.WORLD if world > 1 else None)
    # the ep group never shares WORLD's communicator: on NCCL one communicator runs its collectives in order on
    # one stream, so the forward's and backward's all-to-alls would queue behind the dp grad reduce-scatters
    # and param all-gathers in flight
    ep_group = make([tuple(range(b, b + ep)) for b in range(0, world, ep)], own_communicator=True)
    edp_group = make([tuple(range(e, world, ep)) for e in range(ep)])
    return ParallelState(world, rank, local_rank, dp, ep_group, edp_group, backend, device)


def collective_timeout_s(parallel_cfg: "ParallelConfig") -> float:
    """Seconds a collective waits for the other ranks (`parallel.distributed_timeout_minutes`)."""
    return float(parallel_cfg.distributed_timeout_minutes) * 60.0


def init_distributed(parallel_cfg: "ParallelConfig", timeout_s: float | None = None,
                     device: torch.device | None = None) -> ParallelState:  # fmt: skip
    """Join the job torchrun started and build the groups.

    Reads the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). World size 1
    (no variables, or WORLD_SIZE=1) returns the trivial state without touching torch.distributed.
    NCCL on CUDA (after `torch.cuda.set_device(LOCAL_RANK)`), gloo on CPU: on the `device` the process trains
    on (`train.device` as `runtime.pick_device` chose it), else CUDA wherever it is available. A CPU run on a
    GPU host must get gloo: NCCL has no CPU tensors ("No backend type associated with device type cpu"
    at the first broadcast). The timeout (default:
    `parallel.distributed_timeout_minutes`) bounds every collective: a hung or dead peer makes the others
    fail, naming the step (trainer/parallel/failures.py), instead of waiting forever.
    """
    if timeout_s is None:
        timeout_s = collective_timeout_s(parallel_cfg)
    ep = parallel_cfg.expert_model_parallel_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device is None:
            device = _default_device(local_rank)
        if world == 1:
            check_ep_size(1, ep)
            return ParallelState.trivial(device)
        check_ep_size(world, ep)  # fail before the rendezvous, with a readable error
        if device.type == "cuda":
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend=backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return build_parallel_state(ep, timeout_s)


def destroy_distributed() -> None:
    """Tear down the process groups, if any (end of a run or a test).

    This unregisters every group and shuts down what the backend can shut down (NCCL aborts its
    communicators). It does not stop gloo's worker threads while Python still holds a reference to the
    group (a `ParallelState`, a model's buckets): those go when the last reference does, possibly during
    the interpreter's exit, which is why the CLI ends a multi-rank worker with `os._exit`
    (moectl/cli/exit_codes.py, issue 18). After a failed collective the backend may refuse; the process
    is ending anyway, so that is not an error here.
    """
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group cannot be torn down more cleanly than this
            pass


def dense_seed(seed: int, pstate: ParallelState) -> int:
    """The init seed of replicated (dense) params: the same on every rank, so dp replicas agree."""
    del pstate  # identical everywhere by design; the argument documents the intent at call sites
    return seed


def expert_seed(seed: int, pstate: ParallelState) -> int:
    """The init seed of expert-parallel params: equal across expert-dp replicas, distinct per ep rank."""
    return seed + EXPERT_SEED_OFFSET + EXPERT_SEED_STRIDE * pstate.ep_rank
