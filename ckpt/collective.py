"""The few collectives a save needs, without pickle.

`torch.distributed.all_gather_object` and `broadcast_object_list` pickle their payload. Between our own
processes that would be safe, but a checkpoint path that never touches pickle is easier to audit, so
these move JSON text as uint8 tensors instead. With no process group (one process) every call is the
identity. Ranks are group ranks; `Comm.global_rank` is what error messages name (what logs show).
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Comm:
    """Where this process stands in `group` (None: the default group, or no distributed run at all)."""

    rank: int
    world: int
    global_rank: int
    group: Any
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world > 1


# `group=SOLO`: this process alone, even inside a distributed job (a one-process tool such as convert,
# called on one rank, must not issue collectives the other ranks never join).
SOLO = "solo"


def comm_for(group: Any = None) -> Comm:
    """The `Comm` of this process in `group`; a one-process `Comm` when torch.distributed is not initialised
    or `group` is `SOLO`."""
    if group is SOLO or not (dist.is_available() and dist.is_initialized()):
        return Comm(0, 1, 0, None, torch.device("cpu"))
    # NCCL only moves CUDA tensors; gloo (CPU runs and tests) only CPU ones.
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return Comm(dist.get_rank(group), dist.get_world_size(group), dist.get_rank(), group, device)


def _src(comm: Comm) -> int:
    # broadcast takes a global rank; group rank 0 of a subgroup is not global rank 0.
    return 0 if comm.group is None else dist.get_global_rank(comm.group, 0)


def broadcast_int(comm: Comm, value: int) -> int:
    """Group rank 0's `value` (a signed 64-bit int), on every rank."""
    if not comm.distributed:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=comm.device)
    dist.broadcast(t, src=_src(comm), group=comm.group)
    return int(t.item())


def all_gather_json(comm: Comm, obj: Any) -> list[Any]:
    """Every rank's JSON-serialisable `obj`, in group-rank order, on every rank."""
    if not comm.distributed:
        return [obj]
    data = torch.frombuffer(bytearray(json.dumps(obj).encode("utf-8")), dtype=torch.uint8).to(comm.device)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=comm.device)
    sizes = [torch.empty_like(n) for _ in range(comm.world)]
    dist.all_gather(sizes, n, group=comm.group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=comm.device)
    padded[: data.numel()] = data
    out = [torch.empty_like(padded) for _ in range(comm.world)]
    dist.all_gather(out, padded, group=comm.group)
    return [json.loads(_bytes(o[: int(s.item())])) for o, s in zip(out, sizes)]


def broadcast_json(comm: Comm, obj: Any) -> Any:
    """Group rank 0's JSON-serialisable `obj`, on every rank (other ranks' `obj` is ignored)."""
    if not comm.distributed:
        return obj
    raw = json.dumps(obj).encode("utf-8") if comm.rank == 0 else b""
    n = broadcast_int(comm, len(raw))
    buf = torch.zeros(n, dtype=torch.uint8, device=comm.device)
    if comm.rank == 0 and n:
        buf[:] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(buf, src=_src(comm), group=comm.group)
    return json.loads(_bytes(buf))


def _bytes(t: torch.Tensor) -> bytes:
    """The bytes of a 1-D uint8 tensor (a copy; `tolist()` would be ~40x slower on MB-sized indexes)."""
    c = t.cpu().contiguous()
    return ctypes.string_at(c.data_ptr(), c.numel()) if c.numel() else b""
