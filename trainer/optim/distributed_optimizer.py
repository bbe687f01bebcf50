"""`DistributedOptimizer`: AdamW with fp32 masters, sharded over data-parallel ranks (ZeRO-1).

It steps the buffers of one optimizer tag of a `DistributedModel`. Invariants:

- masters are fp32 and sharded: for each bucket, this rank owns [r*S, (r+1)*S) of the bucket
  (r = its rank in the bucket's group: dp for dense, expert-dp for expert buckets) and keeps masters and
  Adam moments for that range only, as one flat tensor per bucket. Params may straddle shard
  boundaries; padding elements have zero masters and zero updates. With `use_distributed_optimizer:
  false` (plain DDP) every rank owns and steps whole buckets, with the same code;
- masters are built from `ParamStorage.init_source` (the high-precision values, never a dequantized
  low-precision param), and every rank releases the init sources afterwards;
- the grad norm is global (every shard, dp and ep rank, each element counted once) and agreed on by
  all ranks together with a found-inf flag: under `on_nonfinite: stop` every rank raises
  `NonFiniteGradError`; under `skip` every rank returns `skipped=True` with masters, moments, step count,
  params and grads bit-unchanged;
- weight decay applies to matrices only (not to 1-D params, and not to biases of any shape, e.g. a
  grouped `[E, out]` bias, whose per-expert twin is 1-D);
- after the update, each owned group is staged (masters written into this rank's shard of the param
  buffer through the storage strategy) and gathered now, or lazily by the next forward's pre-hooks with
  `overlap_param_gather`;
- storages that need scales agreed over the ranks (per-tensor FP8 param gather) get them from ONE
  `prepare_stage` per master version (one amax all-reduce per process group for all their params, right
  after the step); staging with scales of older masters is impossible: the stager prepares first when
  the masters changed since;
- quantized storages have no live weights until a first stage + gather: `register_optimizer` runs it once
  the masters exist, so the model's quantized weights are the recipe's quantization of the masters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from moectl.config.schema import OptimizerConfig
from trainer.distributed.bucket import Bucket, Piece
from trainer.distributed.bucket_group import BucketGroup, GradSyncError
from trainer.distributed.ddp import DEFAULT_OPTIMIZER_TAG, DistributedModel
from trainer.distributed.param_sync import Action
from trainer.optim.adamw import adamw_update_, fused_adamw_update_
from trainer.optim.grad_norm import clip_coefficient, global_norm_and_found_inf, local_sq_sum
from trainer.optim.logical_state import gather_logical_state
from trainer.optim.step_result import NonFiniteGradError, StepResult

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


def decays(name: str, param: torch.nn.Parameter) -> bool:
    """Whether AdamW decays `param`: matrices yes; 1-D params (norms, biases) and biases of any shape no."""
    leaf = name.rsplit(".", 1)[-1]
    return param.dim() >= 2 and not leaf.startswith("bias")


@dataclass
class _Shard:
    """This rank's slice of one bucket: what it steps ([lo, hi)) and what it counts in the norm."""

    bucket: Bucket
    lo: int
    hi: int
    norm_lo: int
    norm_hi: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    pieces: list[Piece]
    decay_ranges: list[tuple[int, int]] = field(default_factory=list)  # shard-local
    runs: list[tuple[int, int, bool]] = field(default_factory=list)  # a partition of [0, hi-lo): (a, b, decay)

    def grad(self) -> torch.Tensor:
        return self.bucket.grad_data[self.lo:self.hi]

    def norm_grad(self) -> torch.Tensor:
        return self.bucket.grad_data[self.norm_lo:self.norm_hi]


class DistributedOptimizer:
    def __init__(self, dmodel: DistributedModel, cfg: OptimizerConfig, *, tag: str = DEFAULT_OPTIMIZER_TAG,
                 on_nonfinite: Literal["stop", "skip"] = "stop", fused: bool | None = None) -> None:
        if on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'skip', got {on_nonfinite!r}")
        self.dmodel = dmodel
        self.cfg = cfg
        self.tag = tag
        self.on_nonfinite = on_nonfinite
        self.sharded = dmodel.use_distributed_optimizer
        self.buffers = dmodel.buffers_for(tag)
        if not self.buffers:
            raise ValueError(f"no buffers are tagged {tag!r}")
        self.device = self.buffers[0].device
        self.fused = self.device.type == "cuda" if fused is None else fused
        self.step_count = 0
        self.skipped_steps = 0
        self._step_tensor = torch.zeros((), dtype=torch.float32, device=self.device)

        self.shards: list[_Shard] = []
        self._shard_of: dict[Bucket, _Shard] = {}
        for buf in self.buffers:
            for bucket in buf.buckets:
                shard = self._make_shard(bucket)
                self.shards.append(shard)
                self._shard_of[bucket] = shard
        self._init_masters()
        self._master_version = 0  # bumped whenever masters change
        self._scales_version = -1  # the master version prepare_stage last ran for
        # Registering also runs the first stage + gather of quantized storages (their live weights).
        self.groups: list[BucketGroup] = dmodel.register_optimizer(tag, self, self._stage_group)

    # ---------------------------------------------------------------- construction
    def _make_shard(self, bucket: Bucket) -> _Shard:
        norm_lo, norm_hi = bucket.shard_range()
        lo, hi = (norm_lo, norm_hi) if self.sharded else (0, bucket.numel)
        n = hi - lo
        zeros = lambda: torch.zeros(n, dtype=torch.float32, device=self.device)  # noqa: E731
        shard = _Shard(bucket, lo, hi, norm_lo, norm_hi, zeros(), zeros(), zeros(), bucket.pieces(lo, hi))
        names = bucket.buffer.names
        cursor = 0
        for pc in shard.pieces:
            a, b = pc.bucket_lo - lo, pc.bucket_hi - lo
            if a > cursor:
                shard.runs.append((cursor, a, False))  # padding
            d = decays(names[pc.param], pc.param)
            shard.runs.append((a, b, d))
            if d:
                shard.decay_ranges.append((a, b))
            cursor = b
        if cursor < n:
            shard.runs.append((cursor, n, False))
        return shard

    @torch.no_grad()
    def _init_masters(self) -> None:
        for shard in self.shards:
            storage = shard.bucket.buffer.storage
            for pc in shard.pieces:
                src = storage.init_source(pc.param).reshape(-1)[pc.param_lo:pc.param_hi]
                shard.master[pc.bucket_lo - shard.lo:pc.bucket_hi - shard.lo].copy_(src)
        for buf in self.buffers:  # every rank frees every init copy, owned range or not (Megatron #5470)
            for p in buf.params:
                buf.storage.release_init_source(p)

    # ---------------------------------------------------------------- the step
    def _prepare_scales(self) -> None:
        """One `prepare_stage` per storage that needs scales, over this rank's shards of all its buckets."""
        by_storage: dict[int, tuple[Any, list]] = {}
        for s in self.shards:
            st = s.bucket.buffer.storage
            if st.needs_scales:
                by_storage.setdefault(id(st), (st, []))[1].append((s.bucket, s.lo, s.hi, s.master))
        for st, shards in by_storage.values():
            st.prepare_stage(shards)
        self._scales_version = self._master_version

    def _stage_group(self, group: BucketGroup) -> None:
        if group.storage.needs_scales and self._scales_version != self._master_version:
            self._prepare_scales()  # every rank stages groups in the same order: the collective lines up
        for bucket in group.buckets:
            shard = self._shard_of[bucket]
            bucket.buffer.storage.stage(bucket, shard.lo, shard.hi, shard.master)

    def local_grad_sq(self) -> torch.Tensor:
        """This rank's counted sum of squares (float64 scalar): a chained optimizer adds these up."""
        return local_sq_sum([s.norm_grad() for s in self.shards], self.device)

    def _check_ready(self) -> None:
        if not self.dmodel.grads_reduced(self.tag):
            raise GradSyncError("optimizer.step() before DistributedModel.finish_grad_sync(): grads are not reduced")
        for g in self.groups:  # fail before touching masters, not halfway through
            g.sync.check(Action.STAGE)

    @torch.no_grad()
    def step(self, lr: float, *, joint_norm: tuple[float, bool] | None = None) -> StepResult:
        """Clip by the global norm, update masters, write back, gather (now or in the next forward).

        `joint_norm`: (norm, found_inf) a `ChainedOptimizer` agreed over all its optimizers; None: our own.
        """
        self._check_ready()
        norm, found_inf = joint_norm or global_norm_and_found_inf(self.local_grad_sq(), self.dmodel.pstate.dp)
        if found_inf:
            self.skipped_steps += 1
            if self.on_nonfinite == "stop":
                raise NonFiniteGradError(norm, self.step_count + 1)
            return StepResult(norm, skipped=True)

        coef = clip_coefficient(norm, self.cfg.clip_grad)
        self.step_count += 1
        self._step_tensor.fill_(float(self.step_count))
        hp = dict(lr=lr, beta1=self.cfg.adam_beta1, beta2=self.cfg.adam_beta2, eps=self.cfg.adam_eps)
        decay_lists: list[list[torch.Tensor]] = [[], [], [], []]
        plain_lists: list[list[torch.Tensor]] = [[], [], [], []]
        for s in self.shards:
            grad = s.grad()
            if grad.dtype != torch.float32:
                grad = grad.float()
            if coef < 1.0:
                grad.mul_(coef)  # torch's clip multiplies by min(1, coef); x * 1.0 is x, so skipping it is exact
            if not self.fused:
                adamw_update_(s.master, grad, s.exp_avg, s.exp_avg_sq, step=self.step_count,
                              weight_decay=self.cfg.weight_decay, decay_ranges=s.decay_ranges, **hp)
                continue
            for a, b, d in s.runs:
                lists = decay_lists if d else plain_lists
                for lst, t in zip(lists, (s.master, grad, s.exp_avg, s.exp_avg_sq)):
                    lst.append(t[a:b])
        if self.fused:
            fused_adamw_update_(*decay_lists, step=self._step_tensor, weight_decay=self.cfg.weight_decay, **hp)
            fused_adamw_update_(*plain_lists, step=self._step_tensor, weight_decay=0.0, **hp)

        self._master_version += 1
        if any(g.storage.needs_scales for g in self.groups):
            self._prepare_scales()  # the one amax all-reduce of the step, before any group stages
        for g in self.groups:
            g.stage()
        if not self.dmodel.overlap_param_gather:
            self.dmodel.start_param_sync(force_sync=True, tag=self.tag)
        return StepResult(norm, skipped=False)

    # ---------------------------------------------------------------- logical (unsharded) state
    def gather_logical_state(self) -> dict[str, Any]:
        """Full masters and moments per param name, on every rank (collective when sharded).

        `{"step": int, "params": {name: {"master", "exp_avg", "exp_avg_sq": fp32 tensors of the param's
        shape}}}`. Expert entries cover this ep rank's experts only.
        """
        return gather_logical_state(self.shards, STATE_KEYS, self.step_count, self.device)

    @torch.no_grad()
    def load_logical_state(self, state: dict[str, Any], strict: bool = True) -> None:
        """Take this rank's ranges of full per-name masters (and moments, and step, where present).

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
            names = s.bucket.buffer.names
            for pc in s.pieces:
                entry = params.get(names[pc.param])
                if entry is None:
                    continue
                for key in STATE_KEYS:
                    if key not in entry:
                        continue
                    src = entry[key]
                    if tuple(src.shape) != tuple(pc.param.shape):
                        raise ValueError(
                            f"{names[pc.param]}.{key}: shape {tuple(src.shape)} != param {tuple(pc.param.shape)}"
                        )
                    getattr(s, key)[pc.bucket_lo - s.lo:pc.bucket_hi - s.lo].copy_(
                        src.reshape(-1)[pc.param_lo:pc.param_hi]
                    )
        if "step" in state:
            self.step_count = int(state["step"])
        self._master_version += 1
        for g in self.groups:
            g.stage()
        self.dmodel.start_param_sync(force_sync=True, tag=self.tag)
