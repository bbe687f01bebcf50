"""What every optimizer over the bucket shards of a `DistributedModel` does the same way.

`DistributedOptimizer` (AdamW, shards that may cut through params) and `LayerWiseMuon` (Muon, shards of
whole matrices) differ in how a bucket's shard is cut into pieces and in the update math; the rest is
this base:

- one `ShardBase` per bucket: this rank steps [lo, hi) of it (its own shard when sharded, the whole
  bucket under plain DDP) and counts [norm_lo, norm_hi) (always its own shard) in the grad norm, so every
  element is counted once over the world; its fp32 state is one flat tensor per state key;
- the master of an fp32 param IS the param buffer's range (`ParamStorage.master_view`; Megatron's
  distributed optimizer does the same for fp32 params): the update writes the param in place and
  staging skips it, so nothing is written back. Other params (bf16, quantized) keep a separate fp32
  master that staging writes into the buffer, unless the update wrote the buffer itself
  (`ShardBase.published`: AdamW's Triton kernel and Muon's apply pass cast their new masters into the
  buffers whose storage offers it, `ParamStorage.publish_view`);
- masters are built from `ParamStorage.init_source` (the high-precision values, never a dequantized
  low-precision param), and every rank releases every init source afterwards;
- the step checks readiness before touching any master, agrees on the global norm and a found-inf flag
  with all ranks on the device (or takes a `ChainedOptimizer`'s `joint_norm`): under `on_nonfinite:
  stop` every rank raises `NonFiniteGradError`; under `skip` every rank returns `skipped=True` with
  state, step count, params and grads bit-unchanged; then clips, updates (the subclass), stages every
  owned group and gathers now, or lazily by the next forward's pre-hooks with `overlap_param_gather`.
  A subclass whose update takes the verdict as device tensors (`device_verdict`: fused AdamW's
  `grad_scale`/`found_inf`, Muon's clip factor and flag on CUDA) has its update queued before the host
  reads the verdict, so there is no host sync between the norm and the update; the others read it first
  and clip by a host factor;
- `load_logical_state` takes this rank's ranges of full per-name state and writes the masters into the
  params (stage + synchronous gather).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, NamedTuple, Optional

import torch

from moectl.core.config.schema import OptimizerConfig
from trainer import grad_sq
from trainer.distributed.bucket import Bucket
from trainer.distributed.bucket_group import BucketGroup, GradSyncError
from trainer.distributed.ddp import DistributedModel
from trainer.distributed.param_sync import Action
from trainer.optim.grad_norm import GradVerdict, clip_coefficient, global_grad_verdict, local_sq_sum
from trainer.optim.logical_state import gather_logical_state
from trainer.optim.step_result import NonFiniteGradError, StepResult
from trainer.switches import switched_off


#: "0": optimizers stage their bf16 params after the update instead of writing them in it (`ShardBase.publish_target`)
PUBLISH_ENV = "MOECTL_PUBLISH"


class Segment(NamedTuple):
    """One param's elements in a shard: shard-local [lo, hi) holds the param's flat [param_lo, param_hi)."""

    name: str
    param: torch.nn.Parameter
    lo: int
    hi: int
    param_lo: int
    param_hi: int


@dataclass
class ShardBase:
    """This rank's slice of one bucket: what it steps ([lo, hi)), what it counts in the norm, its masters.
    `published`: the last update wrote the new masters into this range of the param buffer itself."""

    bucket: Bucket
    lo: int
    hi: int
    norm_lo: int
    norm_hi: int
    master: torch.Tensor
    published: bool = field(default=False, init=False)

    def grad(self) -> torch.Tensor:
        return self.bucket.grad_data[self.lo:self.hi]

    def norm_grad(self) -> torch.Tensor:
        return self.bucket.grad_data[self.norm_lo:self.norm_hi]

    @property
    def aliased(self) -> bool:
        """Whether `master` is this shard's own range of the param buffer (an fp32 param: no write-back)."""
        data = self.bucket.param_data
        return (self.master.dtype == data.dtype and self.master.numel() == self.hi - self.lo
                and self.master.data_ptr() == data[self.lo:self.hi].data_ptr())

    @property
    def written_by_update(self) -> bool:
        """Whether the last update already wrote this shard's range of the param buffer (then staging skips
        it): an aliased master, or masters the update published."""
        return self.aliased or self.published

    def publish_target(self) -> Optional[torch.Tensor]:
        """This range of the param buffer, where an update may write the new masters itself: what the
        storage offers (`ParamStorage.publish_view`: a plain high-precision buffer, whose staging is that cast
        copy and nothing else); None for an aliased master, or where the storage must stage (quantizing,
        grad-aliased)."""
        if self.aliased or switched_off(PUBLISH_ENV):
            return None
        return self.bucket.buffer.storage.publish_view(self.bucket, self.lo, self.hi)

    def stage(self) -> None:
        """Write this shard's masters into its range of the param buffer through the buffer's storage."""
        self.bucket.buffer.storage.stage(self.bucket, self.lo, self.hi, self.master)

    def segments(self) -> Iterator[Segment]:
        """The params (or pieces of params) in [lo, hi), in bucket order."""
        raise NotImplementedError


class ShardedOptimizerBase:
    """Base of the optimizers over one tag's buffers. Subclasses set `STATE_KEYS`, cut shards
    (`_make_shard`, masters from `_new_master`), update masters (`_update`, and `_update_on_device` where
    `device_verdict` holds), and call `_build()` last in their `__init__`.

    `alias_masters=False` keeps a separate fp32 master even for fp32 params (tests compare the two).
    """

    STATE_KEYS: tuple[str, ...] = ()

    def __init__(self, dmodel: DistributedModel, cfg: OptimizerConfig, *, tag: str,
                 on_nonfinite: Literal["stop", "skip"], alias_masters: bool = True) -> None:
        if on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'skip', got {on_nonfinite!r}")
        self.dmodel = dmodel
        self.cfg = cfg
        self.tag = tag
        self.on_nonfinite = on_nonfinite
        self.alias_masters = alias_masters
        self.sharded = dmodel.use_distributed_optimizer
        self.buffers = dmodel.buffers_for(tag)
        if not self.buffers:
            raise ValueError(f"no buffers are tagged {tag!r}")
        self.device = self.buffers[0].device
        self.step_count = 0
        self.skipped_steps = 0

    # ---------------------------------------------------------------- construction
    def _build(self) -> None:
        """Cut every bucket into this rank's shard, build the masters, register with the model.

        Registering also runs the first stage + gather of quantized storages (their live weights), so
        `_stage_group` must be able to run by then.
        """
        self.shards: list[Any] = []
        self._shard_of: dict[Bucket, Any] = {}
        for buf in self.buffers:
            for bucket in buf.buckets:
                shard = self._make_shard(bucket)
                self.shards.append(shard)
                self._shard_of[bucket] = shard
        self._init_masters()
        self.groups: list[BucketGroup] = self.dmodel.register_optimizer(self.tag, self, self._stage_group)

    def _make_shard(self, bucket: Bucket) -> ShardBase:
        raise NotImplementedError

    def _shard_ranges(self, bucket: Bucket) -> tuple[int, int, int, int]:
        """(lo, hi, norm_lo, norm_hi): the stepped range (whole bucket unless sharded) and the counted one."""
        norm_lo, norm_hi = bucket.shard_range()
        lo, hi = (norm_lo, norm_hi) if self.sharded else (0, bucket.numel)
        return lo, hi, norm_lo, norm_hi

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float32, device=self.device)

    def _new_master(self, bucket: Bucket, lo: int, hi: int) -> torch.Tensor:
        """The fp32 masters of bucket-local [lo, hi): the param buffer's own range where its storage offers
        it (fp32 params), else a zero tensor that `_init_masters` fills."""
        view = bucket.buffer.storage.master_view(bucket, lo, hi) if self.alias_masters else None
        return view if view is not None else self._zeros(hi - lo)

    @torch.no_grad()
    def _init_masters(self) -> None:
        for shard in self.shards:
            if shard.aliased:
                continue  # the param buffer holds the init values already (and every replica's are equal)
            storage = shard.bucket.buffer.storage
            for sg in shard.segments():
                shard.master[sg.lo:sg.hi].copy_(storage.init_source(sg.param).reshape(-1)[sg.param_lo:sg.param_hi])
        for buf in self.buffers:  # every rank frees every init copy, owned range or not (Megatron #5470)
            for p in buf.params:
                buf.storage.release_init_source(p)

    # ---------------------------------------------------------------- the step
    def _stage_group(self, group: BucketGroup) -> None:
        for bucket in group.buckets:
            shard = self._shard_of[bucket]
            if not shard.written_by_update:
                shard.stage()

    def _masters_changed(self, *, stepped: bool) -> None:
        """Called whenever the masters changed (`stepped`: by a step; else by a load), before any group stages."""

    def local_grad_sq(self) -> torch.Tensor:
        """This rank's counted sum of squares (float64 scalar): a chained optimizer adds these up. Grads whose
        writer left their sums of squares (`trainer/grad_sq.py`) are not read again."""
        rest, partials = grad_sq.take_covered([s.norm_grad() for s in self.shards])
        total = local_sq_sum(rest, self.device)
        if partials:
            total = total + torch.cat([p.reshape(-1) for p in partials]).double().sum()
        return total

    def grad_verdict(self, loss: torch.Tensor | None = None) -> GradVerdict:
        """The global norm and found-inf flag over this optimizer's grads (and `loss`, see
        `global_grad_verdict`), agreed by all ranks (on the device)."""
        return global_grad_verdict(self.local_grad_sq(), self.dmodel.pstate.dp, loss)

    @property
    def device_verdict(self) -> bool:
        """Whether `_update_on_device` is used: the update takes clip and skip as device tensors."""
        return False

    def check_ready(self) -> None:
        """Raise unless grads are reduced and every group may be staged (before touching any master)."""
        if not self.dmodel.grads_reduced(self.tag):
            raise GradSyncError("optimizer.step() before DistributedModel.finish_grad_sync(): grads are not reduced")
        for g in self.groups:  # fail before touching masters, not halfway through
            g.sync.check(Action.STAGE)

    _check_ready = check_ready

    def _update(self, lr: float, coef: float) -> None:
        """Update the masters of every shard from its grads times `coef` (`step_count` is already this step's)."""
        raise NotImplementedError

    def _update_on_device(self, lr: float, verdict: GradVerdict) -> None:
        """Queue the update with the verdict still on the device: grads clipped by it (`verdict.grad_scale`
        or `verdict.clip_factor`), masters, moments and grads left bit-unchanged where `verdict.found_inf`
        is 1 (`step_count` is already this step's; the caller takes it back on a skip). Only when
        `device_verdict`."""
        raise NotImplementedError

    def _stage_and_gather(self, *, force_sync: bool) -> None:
        """Stage every owned group; gather now when `force_sync` or not overlapping (else the next forward)."""
        for g in self.groups:
            g.stage()
        if force_sync or not self.dmodel.overlap_param_gather:
            self.dmodel.start_param_sync(force_sync=True, tag=self.tag)

    @torch.no_grad()
    def step(self, lr: float, *, joint_norm: GradVerdict | None = None,
             loss: torch.Tensor | None = None) -> StepResult:  # fmt: skip
        """Clip by the global norm, update masters, write back (separate masters only), gather (now or in the
        next forward).

        `joint_norm`: the verdict a `ChainedOptimizer` agreed over all its optimizers; None: our own.
        `loss`: the step's loss on the device; a non-finite one skips the step as a non-finite grad does.
        """
        self.check_ready()
        verdict = joint_norm if joint_norm is not None else self.grad_verdict(loss)
        if self.device_verdict:
            verdict.start_read()  # queued before the update: the host waits for the norm, not for the update
            self.step_count += 1
            self._update_on_device(lr, verdict)
            norm, found_inf = verdict.read()
            if found_inf:
                self.step_count -= 1  # the kernels skipped: masters, moments and grads are untouched
        else:
            norm, found_inf = verdict.read()
        if found_inf:
            self.skipped_steps += 1
            if self.on_nonfinite == "stop":
                raise NonFiniteGradError(norm, self.step_count + 1)
            return StepResult(norm, skipped=True)

        if not self.device_verdict:
            self.step_count += 1
            self._update(lr, clip_coefficient(norm, self.cfg.clip_grad))
        self._masters_changed(stepped=True)
        self._stage_and_gather(force_sync=False)
        return StepResult(norm, skipped=False)

    # ---------------------------------------------------------------- logical (unsharded) state
    def state_keys(self, name: str) -> tuple[str, ...]:
        """The logical state entries of a param (see `gather_logical_state`): the master and its moments."""
        return self.STATE_KEYS

    def gather_logical_state(self) -> dict[str, Any]:
        """Full state per param name, on every rank (collective when sharded).

        `{"step": int, "params": {name: {key: fp32 tensor of the param's shape for key in STATE_KEYS}}}`.
        Expert entries cover this ep rank's experts only.
        """
        return gather_logical_state(self.shards, self.STATE_KEYS, self.step_count, self.device)

    @torch.no_grad()
    def load_logical_state(self, state: dict[str, Any], strict: bool = True) -> None:
        """Take this rank's ranges of full per-name state (masters, and moments and step where present).

        Then write the masters into the params (stage + synchronous gather), so the model equals them.
        Entries may carry only "master" (loading main params without optimizer state).
        """
        params = state.get("params", {})
        mine = {s.bucket.buffer.names[p] for s in self.shards for p in s.bucket.params}
        missing = sorted(mine - params.keys())
        if strict and missing:
            raise KeyError(f"logical optimizer state lacks {missing}")
        for g in self.groups:
            g.sync.check(Action.STAGE)
        for s in self.shards:
            for sg in s.segments():
                entry = params.get(sg.name)
                if entry is None:
                    continue
                for key in self.STATE_KEYS:
                    if key not in entry:
                        continue
                    src = entry[key]
                    if tuple(src.shape) != tuple(sg.param.shape):
                        raise ValueError(f"{sg.name}.{key}: shape {tuple(src.shape)} != param {tuple(sg.param.shape)}")
                    getattr(s, key)[sg.lo:sg.hi].copy_(src.reshape(-1)[sg.param_lo:sg.param_hi])
        if "step" in state:
            self.step_count = int(state["step"])
        for s in self.shards:  # loaded masters are no update's: staging writes them
            s.published = False
        self._masters_changed(stepped=False)
        self._stage_and_gather(force_sync=True)
