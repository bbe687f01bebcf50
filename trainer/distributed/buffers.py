"""Contiguous param and grad buffers, one per `BufferKey`.

Invariants of a `ParamAndGradBuffer`:
- params are laid out in the order given (backward order: reverse registration, a run of per-expert params
  in expert order where its grouped tensor would be), see `layout.py`; a run's members lie back to back,
  where that tensor would lie, in one bucket;
- every param's `main_grad` is a view of `grad_data` (grad dtype: fp32 with `grad_reduce_in_fp32`);
- with high-precision storage, every param's `.data` is a view of `param_data`, so the all-gather of a
  bucket *is* the param update; with aliased staging, `param_data` is a view of `grad_data`'s memory
  (reinterpreted in the staging dtype) and params keep their own storage;
- padding elements of both buffers are zero, and stay zero (grads never land there; masters of padding
  start at zero and get zero updates);
- a stale-capable param's grad (`stale_ok`: its layer's writer overwrites, `trainer/main_grad.py`) is not
  zero-filled by `zero_grad`: its flag is set instead, and one still set when the grad is about to be
  reduced is zeroed then (`stale_guard`, called by the bucket group). Never in a buffer whose staging aliases the grads
  (staged values are not leftovers) nor in a non-fp32 one (those writers add);
- all params of a buffer share dtype, grad dtype, expert-ness (hence process group), owning optimizer
  and storage strategy: that is the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

import torch

from trainer.distributed.bucket import Bucket
from trainer.distributed.layout import BufferPlan, Runs, plan_buffer
from trainer.distributed.param_storage import ParamStorage
from trainer.kernels.stale_zero import StaleGuard
from trainer.main_grad import STALE_ATTR
from trainer.parallel.groups import Group

if TYPE_CHECKING:
    from trainer.distributed.bucket_group import BucketGroup


#: (params in order, their names, bucket_size, shard group size, each param's run name or None: `layout.Runs`)
#: -> plan; the default is `plan_buffer`
Planner = Callable[[Sequence[torch.nn.Parameter], Mapping[torch.nn.Parameter, str], int, int, Runs], BufferPlan]


@dataclass(frozen=True)
class BufferKey:
    """What must be equal for two params to share a buffer."""

    param_dtype: torch.dtype  # storage dtype (uint8 for quantized storage)
    grad_dtype: torch.dtype
    is_expert: bool  # expert params reduce over expert-dp, dense params over dp
    optimizer_tag: str  # which optimizer owns (steps and gathers) these params
    storage: str  # the ParamStorage strategy's key

    def describe(self) -> str:
        kind = "expert" if self.is_expert else "dense"
        return f"{kind}/{self.optimizer_tag}/{self.param_dtype}->{self.grad_dtype}/{self.storage}"


def alias_as(grad_data: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A 1-D `dtype` view of the first `numel` elements' worth of `grad_data`'s memory.

    With fp32 grads and bf16 staging the staging buffer spans only the first half of the grad memory,
    so bucket k's staging aliases other buckets' grads (as in Megatron): zero only staging slices.
    """
    if torch.empty((), dtype=dtype).element_size() > grad_data.element_size():
        raise ValueError(f"cannot stage {dtype} in a {grad_data.dtype} grad buffer: the staging dtype is wider")
    return grad_data.view(dtype)[:numel]


class ParamAndGradBuffer:
    def __init__(self, key: BufferKey, params: Sequence[torch.nn.Parameter], names: dict[torch.nn.Parameter, str],
                 storage: ParamStorage, group: Group, bucket_size: int, planner: Planner | None = None,
                 stale_ok: frozenset[torch.nn.Parameter] = frozenset(),
                 runs: Mapping[torch.nn.Parameter, str] | None = None) -> None:
        """`runs`: the run name (`layout.Runs`) of each param in a run, e.g. the grouped tensor's name for per-expert
        params (`DistributedModel` passes them); its members must be consecutive in `params`."""
        if not params:
            raise ValueError("a buffer needs at least one param")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"params of one buffer must share a device, got {devices}")
        self.key = key
        self.params = tuple(params)
        self.names = {p: names[p] for p in params}
        self.storage = storage
        self.group = group
        self.device = devices.pop()
        #: each param's run name, or None (`layout.Runs`), in `params` order
        self.runs: tuple[Optional[str], ...] = tuple((runs or {}).get(p) for p in params)
        # A planner (e.g. the layer-wise one: whole params per shard) replaces the default layout.
        self.plan: BufferPlan = (
            planner(self.params, self.names, bucket_size, group.size, self.runs) if planner
            else plan_buffer([p.numel() for p in params], bucket_size, group.size, self.runs)
        )
        self.param_ranges = {p: self.plan.param_ranges[i] for i, p in enumerate(params)}
        total = self.plan.total

        self.grad_data = torch.zeros(total, dtype=key.grad_dtype, device=self.device)
        buffer_dtypes = {storage.buffer_dtype(p) for p in params}
        if len(buffer_dtypes) != 1:
            raise ValueError(f"one buffer, one param-buffer dtype; got {buffer_dtypes}")
        buffer_dtype = buffer_dtypes.pop()
        if storage.aliases_grad:
            self.param_data = alias_as(self.grad_data, buffer_dtype, total)
        else:
            self.param_data = torch.zeros(total, dtype=buffer_dtype, device=self.device)

        for p in params:
            start, end = self.param_ranges[p]
            storage.bind(p, self.param_data[start:end])
            p.main_grad = self.grad_data[start:end].view(p.shape)
        self._bind_stale_flags(stale_ok if key.grad_dtype == torch.float32 and not storage.aliases_grad else frozenset())

        self.buckets = tuple(
            Bucket(self, bp, [params[i] for i in bp.param_indices], self.param_ranges) for bp in self.plan.buckets
        )
        #: set by DistributedModel once bucket groups exist
        self.bucket_groups: list["BucketGroup"] = []

    @property
    def numel(self) -> int:
        return self.plan.total

    def _bind_stale_flags(self, stale_ok: frozenset[torch.nn.Parameter]) -> None:
        """One int32 flag per stale-capable param (views of one tensor: the wgrad kernel addresses them from
        one base), and the grad ranges `zero_grad` still fills: everything else, padding included."""
        stale = [p for p in self.params if p in stale_ok]
        self.stale_flags = torch.zeros(len(stale), dtype=torch.int32, device=self.device)
        for p in self.params:  # a param re-wrapped must not keep an earlier buffer's flag
            if hasattr(p, STALE_ATTR):
                delattr(p, STALE_ATTR)
        for i, p in enumerate(stale):
            setattr(p, STALE_ATTR, self.stale_flags[i:i + 1])
        self.stale_index = {p: i for i, p in enumerate(stale)}
        skipped = sorted(self.param_ranges[p] for p in stale)
        fills, at = [], 0
        for start, end in skipped + [(self.plan.total, self.plan.total)]:
            if start > at:
                fills.append(self.grad_data[at:start])
            at = max(at, end)
        self._zero_fills = fills

    def stale_guard(self, params: Sequence[torch.nn.Parameter]) -> StaleGuard:
        """The guard that zeroes those of `params` still flagged stale when their grads are about to be reduced
        (a layer whose backward did not run this step), `trainer/kernels/stale_zero.py`."""
        ranges = [(*self.param_ranges[p], self.stale_index[p]) for p in params if p in self.stale_index]
        return StaleGuard(self.grad_data, self.stale_flags, ranges)

    def zero_grad(self) -> None:
        """Zero the grad buffer: fill it, except the grads of stale-capable params, whose flags are set instead
        (the caller re-stages aliased staging values afterwards)."""
        if not self.stale_flags.numel():
            self.grad_data.zero_()
            return
        if self._zero_fills:  # none where every param's grad is stale-capable (an expert buffer)
            torch._foreach_zero_(self._zero_fills)
        self.stale_flags.fill_(1)
