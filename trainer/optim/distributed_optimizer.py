"""`DistributedOptimizer`: AdamW with fp32 masters, sharded over data-parallel ranks (ZeRO-1).

It steps the buffers of one optimizer tag of a `DistributedModel`. Invariants:

- masters are fp32 and sharded: for each bucket, this rank owns [r*S, (r+1)*S) of the bucket
  (r = its rank in the bucket's group: dp for dense, expert-dp for expert buckets) and keeps masters and
  Adam moments for that range only, as one flat tensor per bucket. Params may straddle shard
  boundaries; padding elements have zero masters and zero updates. With `use_distributed_optimizer:
  false` (plain DDP) every rank owns and steps whole buckets, with the same code;
- for fp32 params the master IS the param buffer's shard range (a view, as in Megatron): the update
  writes the params in place and nothing is written back; bf16 and quantized params keep separate
  fp32 masters that staging writes into the buffer (for plain bf16/fp16 params the Triton update writes
  them itself and staging skips them);
- masters are built from `ParamStorage.init_source` (the high-precision values, never a dequantized
  low-precision param), and every rank releases the init sources afterwards;
- the grad norm is global (every shard, dp and ep rank, each element counted once) and agreed on by
  all ranks together with a found-inf flag: under `on_nonfinite: stop` every rank raises
  `NonFiniteGradError`; under `skip` every rank returns `skipped=True` with masters, moments, step count,
  params and grads bit-unchanged. Fused (the CUDA default), the verdict stays on the device: the clip
  goes to the kernel as `grad_scale` and the verdict as `found_inf` (the kernel then leaves everything
  untouched), and the host reads (norm, found_inf) only once the update is queued. The kernel is
  `kernels/adamw_triton.py` (one launch per shard, weight decay by per-chunk flags, bf16 params written in
  the same pass so staging skips them) where Triton runs and no chunk mixes decayed and undecayed params
  (params start on its chunks; inside a run of per-expert params, decayed alike, they need not), else
  `torch._fused_adamw_` over per-param runs (`MOECTL_TRITON_ADAMW=0` keeps it). Unfused,
  the host reads the verdict first and multiplies grads by the clip factor (bitwise torch's
  `clip_grad_norm_` + `AdamW(foreach=False)`);
- weight decay applies to matrices only (not to 1-D params, and not to biases of any shape, e.g. a
  grouped `[E, out]` bias, whose per-expert twin is 1-D);
- after the update, each owned group is staged (masters written into this rank's shard of the param
  buffer through the storage strategy, unless the update published them itself) and gathered now, or lazily
  by the next forward's pre-hooks with `overlap_param_gather`;
- storages that need scales agreed over the ranks (per-tensor FP8 param gather) get them from ONE
  `prepare_stage` per master version (one amax all-reduce per process group for all their params, right
  after the step); staging with scales of older masters is impossible: the stager prepares first when
  the masters changed since;
- quantized storages have no live weights until a first stage + gather: `register_optimizer` runs it once
  the masters exist, so the model's quantized weights are the recipe's quantization of the masters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import torch

from moectl.core.arith import ceil_div
from moectl.core.config.schema import OptimizerConfig
from trainer.distributed.bucket import Bucket, Piece
from trainer.distributed.bucket_group import BucketGroup
from trainer.distributed.ddp import DEFAULT_OPTIMIZER_TAG, DistributedModel
from trainer.distributed.layout import PARAM_ALIGN
from trainer.optim.adamw import adamw_update_, fused_adamw_update_
from trainer.optim.grad_norm import GradVerdict
from trainer.optim.grad_norm import clipped
from trainer.kernels import triton_runs
from trainer.optim.sharded_base import Segment, ShardBase, ShardedOptimizerBase

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
#: "0": torch's fused AdamW kernel on CUDA instead of `kernels/adamw_triton.py`
TRITON_ADAMW_ENV = "MOECTL_TRITON_ADAMW"
#: elements per weight-decay flag of the Triton kernel: the layout's param alignment (params start on it, but
#: for the later members of a run of per-expert params: those share chunks only with their run, decayed alike)
DECAY_CHUNK = PARAM_ALIGN


def wants_triton_adamw(device: torch.device) -> bool:
    """Whether fused AdamW on `device` runs `kernels/adamw_triton.py` (CUDA with Triton, not switched off)."""
    return triton_runs(device, TRITON_ADAMW_ENV)


def adamw_triton() -> Any:
    from trainer.kernels import adamw_triton as kernels  # imports Triton: CUDA only, on first use

    return kernels


def chunk_decay_flags(pieces: list[tuple[int, int, bool]], n: int, chunk: int, shift: int = 0) -> torch.Tensor | None:
    """Decay flags (uint8) of an `n`-element shard whose params occupy the disjoint shard-local `pieces`
    (a, b, decay): flag c covers shard elements [c*chunk - shift, (c+1)*chunk - shift), i.e. chunks counted
    from the bucket's start when the shard starts `shift` elements into one (a dp shard need not start on a
    chunk; params do, in the bucket, but inside a run of per-expert params). None where a chunk holds elements
    of a decayed and of an undecayed param.
    Padding between pieces takes its chunk's flag: its masters, grads and moments are zero, so decay leaves it
    zero."""
    flags = torch.zeros(ceil_div(n + shift, chunk), dtype=torch.uint8)
    ends: dict[int, bool] = {}  # only a piece's first and last chunk can be shared with another piece
    for a, b, d in pieces:
        first, last = (a + shift) // chunk, (b - 1 + shift) // chunk
        for c in {first, last}:
            if ends.setdefault(c, d) != d:
                return None
        flags[first:last + 1] = int(d)
    return flags


def decays(name: str, param: torch.nn.Parameter) -> bool:
    """Whether AdamW decays `param`: matrices yes; 1-D params (norms, biases) and biases of any shape no."""
    leaf = name.rsplit(".", 1)[-1]
    return param.dim() >= 2 and not leaf.startswith("bias")


@dataclass
class _Shard(ShardBase):
    """This rank's slice of one bucket: what it steps ([lo, hi)) and what it counts in the norm."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    pieces: list[Piece]
    decay_ranges: list[tuple[int, int]] = field(default_factory=list)  # shard-local
    runs: list[tuple[int, int, bool]] = field(default_factory=list)  # a partition of [0, hi-lo): (a, b, decay)
    decay_flags: torch.Tensor | None = None  # uint8 per `chunk_decay_flags` chunk, for the Triton kernel

    def segments(self) -> Iterator[Segment]:
        """The pieces of params in [lo, hi): a param may straddle the shard's ends."""
        names = self.bucket.buffer.names
        for pc in self.pieces:
            yield Segment(names[pc.param], pc.param, pc.bucket_lo - self.lo, pc.bucket_hi - self.lo,
                          pc.param_lo, pc.param_hi)


class DistributedOptimizer(ShardedOptimizerBase):
    STATE_KEYS = STATE_KEYS

    def __init__(self, dmodel: DistributedModel, cfg: OptimizerConfig, *, tag: str = DEFAULT_OPTIMIZER_TAG,
                 on_nonfinite: Literal["stop", "skip"] = "stop", fused: bool | None = None,
                 alias_masters: bool = True) -> None:
        super().__init__(dmodel, cfg, tag=tag, on_nonfinite=on_nonfinite, alias_masters=alias_masters)
        self.fused = self.device.type == "cuda" if fused is None else fused
        self._triton_wanted = self.fused and wants_triton_adamw(self.device)
        self._step_tensor = torch.zeros((), dtype=torch.float32, device=self.device)
        self._master_version = 0  # bumped whenever masters change
        self._scales_version = -1  # the master version prepare_stage last ran for
        self._build()
        #: one Triton launch per shard (`kernels/adamw_triton.py`, bf16 params written in it) where no shard's
        #: decay-flag chunk mixes decayed and undecayed params; else torch's fused kernel over per-param runs
        self.triton = self._triton_wanted and all(s.decay_flags is not None for s in self.shards)

    # ---------------------------------------------------------------- construction
    def _make_shard(self, bucket: Bucket) -> _Shard:
        lo, hi, norm_lo, norm_hi = self._shard_ranges(bucket)
        n = hi - lo
        shard = _Shard(bucket, lo, hi, norm_lo, norm_hi, self._new_master(bucket, lo, hi), self._zeros(n),
                       self._zeros(n), bucket.pieces(lo, hi))
        names = bucket.buffer.names
        cursor = 0
        params = []  # (a, b, decay) of each piece: the runs without the padding
        for pc in shard.pieces:
            a, b = pc.bucket_lo - lo, pc.bucket_hi - lo
            if a > cursor:
                shard.runs.append((cursor, a, False))  # padding
            d = decays(names[pc.param], pc.param)
            params.append((a, b, d))
            shard.runs.append((a, b, d))
            if d:
                shard.decay_ranges.append((a, b))
            cursor = b
        if cursor < n:
            shard.runs.append((cursor, n, False))
        if self._triton_wanted:
            flags = chunk_decay_flags(params, n, DECAY_CHUNK, shift=lo % DECAY_CHUNK)
            shard.decay_flags = None if flags is None else flags.to(self.device)
        return shard

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
        super()._stage_group(group)

    def _masters_changed(self, *, stepped: bool) -> None:
        self._master_version += 1
        if stepped and any(g.storage.needs_scales for g in self.groups):
            self._prepare_scales()  # the one amax all-reduce of the step, before any group stages

    @property
    def device_verdict(self) -> bool:
        """Fused: the update takes clip and skip as device tensors (no host sync before it)."""
        return self.fused

    def _update(self, lr: float, coef: float) -> None:
        """Unfused AdamW on every shard's masters and moments, grads multiplied by the host's clip `coef`."""
        for s in self.shards:
            adamw_update_(s.master, clipped(s.grad(), coef), s.exp_avg, s.exp_avg_sq, step=self.step_count,
                          weight_decay=self.cfg.weight_decay, decay_ranges=s.decay_ranges, lr=lr,
                          beta1=self.cfg.adam_beta1, beta2=self.cfg.adam_beta2, eps=self.cfg.adam_eps)

    def _fused_lists(self) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        """(decayed, not decayed): the [masters, fp32 grads, exp_avgs, exp_avg_sqs] runs of every shard."""
        decay_lists: list[list[torch.Tensor]] = [[], [], [], []]
        plain_lists: list[list[torch.Tensor]] = [[], [], [], []]
        for s in self.shards:
            grad = s.grad()
            if grad.dtype != torch.float32:
                grad = grad.float()  # the fused kernel takes one dtype for all of its lists
            for a, b, d in s.runs:
                lists = decay_lists if d else plain_lists
                for lst, t in zip(lists, (s.master, grad, s.exp_avg, s.exp_avg_sq)):
                    lst.append(t[a:b])
        return decay_lists, plain_lists

    def _update_on_device(self, lr: float, verdict: GradVerdict) -> None:
        """Fused AdamW gated by the device verdict: one Triton launch per shard (`self.triton`), or torch's
        multi-tensor calls, decayed and not.

        A skipped step (found_inf) changes no master and no param, so the params still equal the masters cast
        (`published` is set either way; a skipped step does not stage). Unlike torch's kernel with a
        `grad_scale`, the Triton kernel leaves the grads unscaled: nothing reads them after the step (the next
        step zeroes them), and the unfused CPU path scales them in place before its update.

        torch's kernel (the fallback): with a `grad_scale` it also stores the divided grads back (4 B/param
        more), so with clipping on two launches are queued and the device flags let exactly one of them run: the one
        without `grad_scale` when no clipping is needed (the common steady state), the scaled one
        otherwise. The other one's blocks read its `found_inf` of 1 and exit, moving no data.
        """
        if self.triton:
            scale = verdict.grad_scale(self.cfg.clip_grad)
            for s in self.shards:
                target = s.publish_target()
                adamw_triton().adamw_(s.master, s.grad(), s.exp_avg, s.exp_avg_sq, s.decay_flags, DECAY_CHUNK,
                                      s.lo % DECAY_CHUNK, step=self.step_count,
                                      lr=lr, beta1=self.cfg.adam_beta1, beta2=self.cfg.adam_beta2,
                                      eps=self.cfg.adam_eps, weight_decay=self.cfg.weight_decay, grad_scale=scale,
                                      found_inf=verdict.found_inf, publish=target)  # fmt: skip
                s.published = target is not None
            return
        self._step_tensor.fill_(float(self.step_count))
        hp = dict(lr=lr, beta1=self.cfg.adam_beta1, beta2=self.cfg.adam_beta2, eps=self.cfg.adam_eps,
                  step=self._step_tensor)
        decay_lists, plain_lists = self._fused_lists()
        scale = verdict.grad_scale(self.cfg.clip_grad)
        if scale is None:
            launches = [(None, verdict.found_inf)]
        else:
            skip, clip = verdict.found_inf > 0, scale > 1  # a nan scale (non-finite norm) is skipped anyway
            launches = [(None, (skip | clip).float()), (scale, (skip | ~clip).float())]
        for grad_scale, found_inf in launches:
            fused_adamw_update_(*decay_lists, weight_decay=self.cfg.weight_decay, grad_scale=grad_scale,
                                found_inf=found_inf, **hp)
            fused_adamw_update_(*plain_lists, weight_decay=0.0, grad_scale=grad_scale, found_inf=found_inf, **hp)
