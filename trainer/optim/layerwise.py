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

Other invariants, shared with `DistributedOptimizer` (`sharded_base.ShardedOptimizerBase`): the master of
an fp32 matrix is its range of the param buffer (`muon_update_` works in place, so the update lands in the
param and nothing is written back); other masters are built from `ParamStorage.init_source` and the init
sources are released on every rank; the grad norm counts each rank's own shard (so every element once
over the world) and a non-finite norm is agreed on by all ranks (`step(joint_norm=...)` takes the verdict
a `ChainedOptimizer` computed over all its optimizers instead). The host reads the verdict before the
update (Newton-Schulz has no `found_inf` input) and clips by a host factor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch

from moectl.core.config.schema import OptimizerConfig
from trainer.distributed.bucket import Bucket
from trainer.distributed.ddp import DistributedModel
from trainer.optim.muon import muon_update_
from trainer.optim.muon_routing import MUON_TAG
from trainer.optim.sharded_base import Segment, ShardBase, ShardedOptimizerBase, clipped

STATE_KEYS = ("master", "momentum_buffer")


@dataclass(frozen=True)
class _Matrix:
    """One owned param: elements [lo, hi) of its shard (shard-local)."""

    name: str
    param: torch.nn.Parameter
    lo: int
    hi: int


@dataclass
class _Shard(ShardBase):
    """The range [lo, hi) of one bucket this rank steps, its fp32 state, and the whole params in it."""

    momentum_buffer: torch.Tensor
    matrices: list[_Matrix] = field(default_factory=list)

    def segments(self) -> Iterator[Segment]:
        """The whole matrices in [lo, hi)."""
        for m in self.matrices:
            yield Segment(m.name, m.param, m.lo, m.hi, 0, m.param.numel())


class LayerWiseMuon(ShardedOptimizerBase):
    STATE_KEYS = STATE_KEYS

    def __init__(self, dmodel: DistributedModel, cfg: OptimizerConfig, *, tag: str = MUON_TAG,
                 on_nonfinite: Literal["stop", "skip"] = "stop",
                 compute_dtype: torch.dtype = torch.float32, alias_masters: bool = True) -> None:
        super().__init__(dmodel, cfg, tag=tag, on_nonfinite=on_nonfinite, alias_masters=alias_masters)
        self.compute_dtype = compute_dtype
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
            if pc.param_lo != 0 or pc.param_hi != pc.param.numel():
                raise ValueError(
                    f"{name} is split across the shards of {bucket.buffer.key.describe()}: Muon needs whole "
                    "matrices; build the DistributedModel with layouts={tag: plan_layerwise_buffer}"
                )
            if pc.param.dim() < 2:
                raise ValueError(f"{name} of shape {tuple(pc.param.shape)} is not a matrix; route it to AdamW")
            shard.matrices.append(_Matrix(name, pc.param, pc.bucket_lo - lo, pc.bucket_hi - lo))
        return shard

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

    # ---------------------------------------------------------------- the step
    def _update(self, lr: float, coef: float) -> None:
        """`muon_update_` on the fp32 master (+ momentum) of every owned matrix, one call per param."""
        hp = dict(lr=lr, momentum=self.cfg.muon_momentum, nesterov=self.cfg.muon_nesterov,
                  ns_steps=self.cfg.muon_ns_steps, weight_decay=self.cfg.weight_decay,
                  compute_dtype=self.compute_dtype)
        for s in self.shards:
            for m in s.matrices:
                shape = m.param.shape
                grad = clipped(s.bucket.grad_data[s.lo + m.lo:s.lo + m.hi].view(shape), coef)
                muon_update_(s.master[m.lo:m.hi].view(shape), grad, s.momentum_buffer[m.lo:m.hi].view(shape), **hp)
