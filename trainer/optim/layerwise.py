"""`LayerWiseMuon`: Muon over the buffers of one optimizer tag, each data-parallel rank owning whole matrices.

Muon needs a param's whole gradient (Newton-Schulz orthogonalises the full matrix), so the ZeRO-1 split
of `DistributedOptimizer` (shards that cut through params) does not fit. Instead the tag's buffers are
laid out by `layerwise_layout.plan_layerwise_buffer`: every bucket shard holds whole matrices (whole
params, or whole expert slices of a grouped `[E, out, in]` weight spread over the group), balanced by
Newton-Schulz FLOPs, and shard r belongs to rank r of the bucket's group (dp for dense params, expert-dp
for expert params, so expert owners are chosen within expert-dp). With that layout the unchanged bucket
machinery does the distribution:

- grads: the bucket reduce-scatter leaves each owner the full reduced grads of its matrices;
- update: each rank runs `muon_batch.muon_step_` over the fp32 masters (+ momentum) of all the matrices
  it owns: one batched Newton-Schulz per group of same-shaped matrices, in `optimizer.muon_compute_dtype`
  (`muon.resolve_compute_dtype`: bf16 on sm80+ GPUs, fp32 on CPU); with `optimizer.muon_split_glu` a gated
  fc1 weight (`muon_routing.glu_rows`) counts as its gate and up halves, and with `optimizer.muon_split_qkv`
  a fused QKV weight (`muon_routing.qkv_rows`) as its query, key and value parts, in the plan's cost as in
  the step;
- params: each owned group is staged (masters -> this rank's shard of the param buffer, through the
  buffer's `ParamStorage`, so low-precision storage can quantize there) and all-gathered now, or lazily
  by the next forward's pre-hooks with `overlap_param_gather`. Where staging is a plain cast copy (bf16
  params), the update's apply pass writes the cast itself (`ShardBase.publish_target`) and staging skips
  the shard: the same bits, one fewer read of every master (`MOECTL_PUBLISH=0` stages as before). Only
  this tag's bucket groups are staged and gathered: bucket groups never mix optimizers (`BucketGroup`
  refuses), so the AdamW optimizer of the same model gathers its own groups and nothing is gathered twice
  (Megatron #6754).

With `use_distributed_optimizer: false` the buckets are all-reduced and every rank steps every matrix
(plain DDP; no gather moves data), with the same code.

Other invariants, shared with `DistributedOptimizer` (`sharded_base.ShardedOptimizerBase`): the master of
an fp32 matrix is its range of the param buffer (the update works in place, so the update lands in the
param and nothing is written back); other masters are built from `ParamStorage.init_source` and the init
sources are released on every rank; the grad norm counts each rank's own shard (so every element once
over the world) and a non-finite norm is agreed on by all ranks (`step(joint_norm=...)` takes the verdict
a `ChainedOptimizer` computed over all its optimizers instead). On CUDA the verdict stays on the device
(`device_verdict`): the blend reads the clip coefficient and the skip flag, the apply reads the flag, and
the host queues the whole step before it reads the norm, so the GPU does not idle while the host launches
Newton-Schulz. On the CPU the host reads the verdict first and clips by a host factor (the coefficient is
the same float64 formula either way, and the update the same operations, so the bits are too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal, Optional

import torch

from moectl.core.config.schema import OptimizerConfig
from moectl.core.facts import GluRows, QkvRows
from trainer.distributed.bucket import Bucket
from trainer.distributed.ddp import DistributedModel
from trainer.optim.grad_norm import GradVerdict
from trainer.optim.muon import resolve_compute_dtype
from trainer.optim.muon_batch import MuonMatrix, muon_step_, qkv_matrices
from trainer.optim.muon_routing import MUON_TAG, ns_shapes, split_glu_rows, split_qkv_rows
from trainer.optim.sharded_base import Segment, ShardBase, ShardedOptimizerBase
from trainer.switches import switched_off

STATE_KEYS = ("master", "momentum_buffer")
DEVICE_VERDICT_ENV = "MOECTL_MUON_DEVICE_VERDICT"


@dataclass(frozen=True)
class _Matrix:
    """One owned run of whole matrices: elements [lo, hi) of its shard (shard-local) hold the param's flat
    [param_lo, param_hi) (the whole param, or whole expert slices of a spread `[E, out, in]` weight).
    `glu`: the row layout of a gated fc1 weight orthogonalised as gate and up halves, `qkv` that of a fused QKV
    weight orthogonalised as its query, key and value parts, else None."""

    name: str
    param: torch.nn.Parameter
    lo: int
    hi: int
    param_lo: int
    param_hi: int
    glu: Optional[GluRows] = None
    qkv: Optional[QkvRows] = None

    @property
    def shape(self) -> torch.Size:
        """The param's shape, or `[k, out, in]` for k of its expert slices."""
        if self.param_hi - self.param_lo == self.param.numel():
            return self.param.shape
        m, n = self.param.shape[-2:]
        return torch.Size(((self.param_hi - self.param_lo) // (m * n), m, n))

    @property
    def ns_shapes(self) -> list[torch.Size]:
        """What Newton-Schulz sees (`muon_routing.ns_shapes`): `[shape]`, gate and up halves, or the QKV parts."""
        return ns_shapes(self.shape, self.glu, self.qkv)

    @property
    def slices(self) -> tuple[int, int]:
        """The param's matrices [first, end) in this run (counting `[out, in]` slices over leading dims)."""
        per = self.param.shape[-2] * self.param.shape[-1]
        return self.param_lo // per, self.param_hi // per


@dataclass
class _Shard(ShardBase):
    """The range [lo, hi) of one bucket this rank steps, its fp32 state, and the whole matrices in it."""

    momentum_buffer: torch.Tensor
    matrices: list[_Matrix] = field(default_factory=list)

    def segments(self) -> Iterator[Segment]:
        """The whole matrices in [lo, hi)."""
        for m in self.matrices:
            yield Segment(m.name, m.param, m.lo, m.hi, m.param_lo, m.param_hi)


def _whole_matrices(param: torch.nn.Parameter, param_lo: int, param_hi: int) -> bool:
    """Whether flat [param_lo, param_hi) of `param` is the whole param or whole `[out, in]` slices of it."""
    if param_lo == 0 and param_hi == param.numel():
        return True
    per = param.shape[-2] * param.shape[-1]
    return param.dim() >= 3 and param_lo % per == 0 and param_hi % per == 0


class LayerWiseMuon(ShardedOptimizerBase):
    STATE_KEYS = STATE_KEYS

    def __init__(self, dmodel: DistributedModel, cfg: OptimizerConfig, *, tag: str = MUON_TAG,
                 on_nonfinite: Literal["stop", "skip"] = "stop",
                 compute_dtype: torch.dtype | None = None, alias_masters: bool = True,
                 device_verdict: bool | None = None) -> None:
        """`compute_dtype`: of Newton-Schulz; None resolves `cfg.muon_compute_dtype` on the params' device.
        `device_verdict`: whether the update reads the verdict on the device (None: on CUDA, unless
        `MOECTL_MUON_DEVICE_VERDICT=0`; see the property)."""
        super().__init__(dmodel, cfg, tag=tag, on_nonfinite=on_nonfinite, alias_masters=alias_masters)
        self.compute_dtype = compute_dtype or resolve_compute_dtype(cfg.muon_compute_dtype, self.device)
        if device_verdict is None:
            device_verdict = self.device.type == "cuda" and not switched_off(DEVICE_VERDICT_ENV)
        self._device_verdict = device_verdict
        for buf in self.buffers:  # per-tensor FP8 scales are agreed from shards: not wired for Muon (MOE010)
            if getattr(buf.storage, "needs_scales", False):
                raise ValueError(f"{buf.key.describe()}: Muon supports no storage with per-tensor scales; use mxfp8 "
                                 "param gather (staged, every rank quantizes the gathered values)")
        self._build()

    # ---------------------------------------------------------------- construction
    def _make_shard(self, bucket: Bucket) -> _Shard:
        lo, hi, norm_lo, norm_hi = self._shard_ranges(bucket)
        shard = _Shard(bucket, lo, hi, norm_lo, norm_hi, self._new_master(bucket, lo, hi), self._zeros(hi - lo))
        names = bucket.buffer.names
        for pc in bucket.pieces(lo, hi):
            name = names[pc.param]
            if pc.param.dim() < 2:
                raise ValueError(f"{name} of shape {tuple(pc.param.shape)} is not a matrix; route it to AdamW")
            if not _whole_matrices(pc.param, pc.param_lo, pc.param_hi):
                raise ValueError(
                    f"{name} is split across the shards of {bucket.buffer.key.describe()} through a matrix: Muon "
                    "needs whole matrices; build the DistributedModel with layouts={tag: plan_layerwise_buffer}"
                )
            shard.matrices.append(_Matrix(name, pc.param, pc.bucket_lo - lo, pc.bucket_hi - lo, pc.param_lo,
                                          pc.param_hi, split_glu_rows(pc.param, self.cfg.muon_split_glu),
                                          split_qkv_rows(pc.param, self.cfg.muon_split_qkv)))
        return shard

    # ---------------------------------------------------------------- ownership
    def ownership(self) -> dict[str, tuple[int, ...] | None]:
        """The owning ranks (indices in the param's dp or expert-dp group) of every param: one rank for a
        whole param, several for a spread grouped weight (each owns a run of its expert slices); None: every
        rank steps the whole param (plain DDP)."""
        out: dict[str, tuple[int, ...] | None] = {}
        for buf in self.buffers:
            for bucket in buf.buckets:
                for p in bucket.params:
                    start, end = bucket.param_ranges[p]
                    out[buf.names[p]] = (tuple(range(start // bucket.shard_size, (end - 1) // bucket.shard_size + 1))
                                         if self.sharded else None)
        return out

    def owned(self) -> list[tuple[str, int, int]]:
        """(name, first, end) of the matrices this rank steps, in buffer order: `[out, in]` slices
        [first, end) of the param (all of them for a 2-D param: (0, 1))."""
        return [(m.name, *m.slices) for s in self.shards for m in s.matrices]

    # ---------------------------------------------------------------- the step
    @property
    def device_verdict(self) -> bool:
        """Whether the update takes the clip coefficient and the skip flag as device tensors, so the host queues
        the whole step (Newton-Schulz included) before it reads the norm: on CUDA by default, where otherwise
        the GPU idles from that read until the host has launched the first batch. The CPU reads the verdict
        first (nothing to overlap; the out-of-place skip would cost passes). `MOECTL_MUON_DEVICE_VERDICT=0` is
        the A/B switch. The bits are the same either way."""
        return self._device_verdict

    def _step_matrices(self, lr: float, grad_scale: float | torch.Tensor,
                       found_inf: Optional[torch.Tensor] = None) -> None:
        """`muon_batch.muon_step_` over every owned matrix's master, grad and momentum (views of the shards), the
        clip and skip as floats or device tensors. Each update is published where staging is a plain cast (the
        shard's range of the param buffer), and the shard marked so (also on a step the flag skips: staging does
        not run then, and the params still equal the masters' cast)."""
        matrices = []
        for s in self.shards:
            target = s.publish_target()
            for m in s.matrices:
                shape = m.shape
                grad = s.bucket.grad_data[s.lo + m.lo:s.lo + m.hi].view(shape)
                publish = None if target is None else target[m.lo:m.hi].view(shape)
                master, momentum = s.master[m.lo:m.hi].view(shape), s.momentum_buffer[m.lo:m.hi].view(shape)
                if m.qkv is not None:
                    matrices += qkv_matrices(master, grad, momentum, m.qkv, publish)
                else:
                    matrices.append(MuonMatrix(master, grad, momentum, m.glu, publish))
            s.published = target is not None  # every matrix of the shard; its padding never changes
        muon_step_(matrices, lr=lr, momentum=self.cfg.muon_momentum, nesterov=self.cfg.muon_nesterov,
                   ns_steps=self.cfg.muon_ns_steps, weight_decay=self.cfg.weight_decay,
                   compute_dtype=self.compute_dtype, grad_scale=grad_scale, found_inf=found_inf,
                   ns_method=self.cfg.muon_ns_method)

    def _update(self, lr: float, coef: float) -> None:
        """One batched Muon step (`muon_batch.muon_step_`) over every owned matrix's fp32 master + momentum."""
        self._step_matrices(lr, coef)

    def _update_on_device(self, lr: float, verdict: GradVerdict) -> None:
        """`_update` with the clip coefficient and the skip flag read by the kernels on the device."""
        coef = verdict.clip_factor(self.cfg.clip_grad)
        self._step_matrices(lr, 1.0 if coef is None else coef, verdict.found_inf)
