"""`LayerWiseMuon`: Muon over the buffers of one optimizer tag, each data-parallel rank owning whole matrices.

Muon needs a param's whole gradient (Newton-Schulz orthogonalises the full matrix), so the ZeRO-1 split
of `DistributedOptimizer` (shards that cut through params) does not fit. Instead the tag's buffers are
laid out by `layerwise_layout.plan_layerwise_buffer`: every bucket shard holds whole params, LPT-balanced
by Newton-Schulz cost, and shard r belongs to rank r of the bucket's group (dp for dense params,
expert-dp for expert params, so expert owners are chosen within expert-dp). With that layout the
unchanged bucket machinery does the distribution:

- grads: the bucket reduce-scatter leaves each owner the full reduced grads of its matrices;
- update: each rank runs `muon.muon_update_` on the fp32 masters (+ momentum) of the matrices it owns,
  one call per param (a grouped `[E, out, in]` expert weight is one batched Newton-Schulz);
- params: each owned group is staged (masters -> this rank's shard of the param buffer, through the
  buffer's `ParamStorage`, so low-precision storage can quantize there) and all-gathered now, or lazily
  by the next forward's pre-hooks with `overlap_param_gather`. Only this tag's bucket groups are
  staged and gathered: bucket groups never mix optimizers (`BucketGroup` refuses), so the AdamW
  optimizer of the same model gathers its own groups and nothing is gathered twice (Megatron #6754).

With `use_distributed_optimizer: false` the buckets are all-reduced and every rank steps every matrix
(plain DDP; no gather moves data), with the same code.

Other invariants, as in `DistributedOptimizer`: masters are built from `ParamStorage.init_source` and the
init sources are released on every rank; the grad norm counts each rank's own shard (so every element
once over the world) and a non-finite norm is agreed on by all ranks (`step(joint_norm=...)` takes the
norm a `ChainedOptimizer` computed over all its optimizers instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from moectl.config.schema import OptimizerConfig
from trainer.distributed.bucket import Bucket
from trainer.distributed.bucket_group import BucketGroup, GradSyncError
from trainer.distributed.ddp import DistributedModel
from trainer.distributed.param_sync import Action
from trainer.optim.grad_norm import clip_coefficient, global_norm_and_found_inf, local_sq_sum
from trainer.optim.logical_state import gather_logical_state
from trainer.optim.muon import muon_update_
from trainer.optim.muon_routing import MUON_TAG
from trainer.optim.step_result import NonFiniteGradError, StepResult

STATE_KEYS = ("master", "momentum_buffer")


@dataclass(frozen=True)
class _Matrix:
    """One owned param: elements [lo, hi) of its shard (shard-local)."""

    name: str
    param: torch.nn.Parameter
    lo: int
    hi: int


@dataclass
class _Shard:
    """The range [lo, hi) of one bucket this rank steps, its fp32 state, and the whole params in it."""

    bucket: Bucket
    lo: int
    hi: int
    norm_lo: int
    norm_hi: int
    master: torch.Tensor
    momentum_buffer: torch.Tensor
    matrices: list[_Matrix] = field(default_factory=list)


class LayerWiseMuon:
    def __init__(self, dmodel: DistributedModel, cfg: OptimizerConfig, *, tag: str = MUON_TAG,
                 on_nonfinite: Literal["stop", "skip"] = "stop",
                 compute_dtype: torch.dtype = torch.float32) -> None:
        if on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'skip', got {on_nonfinite!r}")
        self.dmodel = dmodel
        self.cfg = cfg
        self.tag = tag
        self.on_nonfinite = on_nonfinite
        self.compute_dtype = compute_dtype
        self.sharded = dmodel.use_distributed_optimizer
        self.buffers = dmodel.buffers_for(tag)
        if not self.buffers:
            raise ValueError(f"no buffers are tagged {tag!r}")
        for buf in self.buffers:  # per-tensor FP8 scales are agreed from shards: not wired for Muon (MOE010)
            if getattr(buf.storage, "needs_scales", False):
                raise ValueError(f"{buf.key.describe()}: Muon supports no storage with per-tensor scales; use mxfp8 "
                                 "param gather (staged, every rank quantizes the gathered values)")
        self.device = self.buffers[0].device
        self.step_count = 0
        self.skipped_steps = 0
        self.shards: list[_Shard] = []
        self._shard_of: dict[Bucket, _Shard] = {}
        for buf in self.buffers:
            for bucket in buf.buckets:
                shard = self._make_shard(bucket)
                self.shards.append(shard)
                self._shard_of[bucket] = shard
        self._init_masters()
        self.groups: list[BucketGroup] = dmodel.register_optimizer(tag, self, self._stage_group)

    # ---------------------------------------------------------------- construction
    def _make_shard(self, bucket: Bucket) -> _Shard:
        norm_lo, norm_hi = bucket.shard_range()
        lo, hi = (norm_lo, norm_hi) if self.sharded else (0, bucket.numel)
        zeros = lambda: torch.zeros(hi - lo, dtype=torch.float32, device=self.device)  # noqa: E731
        shard = _Shard(bucket, lo, hi, norm_lo, norm_hi, zeros(), zeros())
        names = bucket.buffer.names
        for pc in bucket.pieces(lo, hi):
            name = names[pc.param]
            if pc.param_lo != 0 or pc.param_hi != pc.param.numel():
                raise ValueError(
                    f"{name} is split across the shards of {bucket.buffer.key.describe()}: Muon needs whole "
                    "matrices; build the DistributedModel with layouts={tag: plan_layerwise_buffer}"
                )
            if pc.param.dim() < 2:
                raise ValueError(f"{name} of shape {tuple(pc.param.shape)} is not a matrix; route it to AdamW")
            shard.matrices.append(_Matrix(name, pc.param, pc.bucket_lo - lo, pc.bucket_hi - lo))
        return shard

    @torch.no_grad()
    def _init_masters(self) -> None:
        for shard in self.shards:
            storage = shard.bucket.buffer.storage
            for m in shard.matrices:
                shard.master[m.lo:m.hi].copy_(storage.init_source(m.param).reshape(-1))
        for buf in self.buffers:  # every rank frees every init copy, owned or not (Megatron #5470)
            for p in buf.params:
                buf.storage.release_init_source(p)

    # ---------------------------------------------------------------- ownership
    def ownership(self) -> dict[str, int | None]:
        """The owning rank (index in the param's dp or expert-dp group) of every param; None: every rank."""
        out: dict[str, int | None] = {}
        for buf in self.buffers:
            for bucket in buf.buckets:
                for p in bucket.params:
                    start = bucket.param_ranges[p][0]
                    out[buf.names[p]] = start // bucket.shard_size if self.sharded else None
        return out

    def owned_names(self) -> list[str]:
        """Names of the matrices this rank steps, in buffer order."""
        return [m.name for s in self.shards for m in s.matrices]

    def state_keys(self, name: str) -> tuple[str, ...]:
        """The logical state entries of a param (see `gather_logical_state`)."""
        return STATE_KEYS

    # ---------------------------------------------------------------- the step
    def _stage_group(self, group: BucketGroup) -> None:
        for bucket in group.buckets:
            shard = self._shard_of[bucket]
            bucket.buffer.storage.stage(bucket, shard.lo, shard.hi, shard.master)

    def local_grad_sq(self) -> torch.Tensor:
        """This rank's counted sum of squares (float64 scalar): its own shard of every bucket."""
        return local_sq_sum([s.bucket.grad_data[s.norm_lo:s.norm_hi] for s in self.shards], self.device)

    def check_ready(self) -> None:
        """Raise unless grads are reduced and every group may be staged (before touching any master)."""
        if not self.dmodel.grads_reduced(self.tag):
            raise GradSyncError("optimizer.step() before DistributedModel.finish_grad_sync(): grads are not reduced")
        for g in self.groups:
            g.sync.check(Action.STAGE)

    @torch.no_grad()
    def step(self, lr: float, *, joint_norm: tuple[float, bool] | None = None) -> StepResult:
        """Clip by the global norm, Muon-update the owned masters, write back, gather (now or lazily).

        `joint_norm`: (norm, found_inf) already agreed by all ranks over every optimizer of a chain;
        None computes this optimizer's own.
        """
        self.check_ready()
        if joint_norm is None:
            joint_norm = global_norm_and_found_inf(self.local_grad_sq(), self.dmodel.pstate.dp)
        norm, found_inf = joint_norm
        if found_inf:
            self.skipped_steps += 1
            if self.on_nonfinite == "stop":
                raise NonFiniteGradError(norm, self.step_count + 1)
            return StepResult(norm, skipped=True)

        coef = clip_coefficient(norm, self.cfg.clip_grad)
        self.step_count += 1
        hp = dict(lr=lr, momentum=self.cfg.muon_momentum, nesterov=self.cfg.muon_nesterov,
                  ns_steps=self.cfg.muon_ns_steps, weight_decay=self.cfg.weight_decay,
                  compute_dtype=self.compute_dtype)
        for s in self.shards:
            for m in s.matrices:
                shape = m.param.shape
                grad = s.bucket.grad_data[s.lo + m.lo:s.lo + m.hi].view(shape)
                if grad.dtype != torch.float32:
                    grad = grad.float()
                if coef < 1.0:
                    grad.mul_(coef)  # the same clip multiply as AdamW's; x * 1.0 is x, so skipping it is exact
                muon_update_(s.master[m.lo:m.hi].view(shape), grad, s.momentum_buffer[m.lo:m.hi].view(shape), **hp)

        for g in self.groups:
            g.stage()
        if not self.dmodel.overlap_param_gather:
            self.dmodel.start_param_sync(force_sync=True, tag=self.tag)
        return StepResult(norm, skipped=False)

    # ---------------------------------------------------------------- logical (unsharded) state
    def gather_logical_state(self) -> dict[str, Any]:
        """`{"step", "params": {name: {"master", "momentum_buffer"}}}`, full tensors on every rank (collective).

        Expert entries cover this ep rank's experts only.
        """
        return gather_logical_state(self.shards, STATE_KEYS, self.step_count, self.device)

    @torch.no_grad()
    def load_logical_state(self, state: dict[str, Any], strict: bool = True) -> None:
        """Take this rank's matrices from full per-name state (entries may carry only "master").

        Then write the masters into the params (stage + synchronous gather), so the model equals them.
        """
        params = state.get("params", {})
        mine = {s.bucket.buffer.names[p] for s in self.shards for p in s.bucket.params}
        missing = sorted(mine - params.keys())
        if strict and missing:
            raise KeyError(f"logical optimizer state lacks {missing}")
        for g in self.groups:
            g.sync.check(Action.STAGE)
        for s in self.shards:
            for m in s.matrices:
                entry = params.get(m.name)
                if entry is None:
                    continue
                for key in STATE_KEYS:
                    if key not in entry:
                        continue
                    src = entry[key]
                    if tuple(src.shape) != tuple(m.param.shape):
                        raise ValueError(f"{m.name}.{key}: shape {tuple(src.shape)} != param {tuple(m.param.shape)}")
                    getattr(s, key)[m.lo:m.hi].copy_(src.reshape(-1))
        if "step" in state:
            self.step_count = int(state["step"])
        for g in self.groups:
            g.stage()
        self.dmodel.start_param_sync(force_sync=True, tag=self.tag)
