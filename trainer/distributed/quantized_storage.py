"""Quantized param storage: the low-precision param gather (`fp8_param_gather`, `fp4_param_gather`).

The params of every recipe-run weight (see `weight_sites.py`) are stored low precision only: at wrap time
(`bind`) the high-precision init values move to a CPU copy (the optimizer's master source, freed on every
rank once masters exist: Megatron #4987 lost 0.27 nats building masters from dequantized FP8, #5470 leaked
the copies of params a rank does not own) and the param's `.data` becomes a one-element placeholder. The
layers read the quantized weight from their `quantized_weight` hook. Two strategies:

`PerTensorFP8Storage` (fp8 `tensorwise`, `delayed`): the param buffer is uint8, one FP8 byte per element.
    prepare_stage  every rank takes the amax of its master shard (per tensor, per expert of a grouped
                   weight); ONE all-reduce (MAX) per process group agrees on all of them; scales follow
                   (tensorwise: FP8_MAX / amax; delayed: the weight's amax history, then the amax is recorded)
    stage          this rank's shard of FP8 bytes = cast(master * scale) (`precision/shard.py`), and the
                   scales are snapshotted with the bucket (one flat tensor), so they travel with the bytes
                   they encode
    gather         the buffer all-gather ships bytes (1 byte per param)
    post_gather    rowwise data = a view of the gathered bytes, decode scales = 1 / scale (one kernel per
                   bucket); published to the model rowwise only. The columnwise copy (the exact transpose,
                   needed by dgrad only) is built at its first use and cached on the published tensor until
                   the next gather publishes new ones (`QuantizedTensor.with_columnwise`), as TE does on
                   Hopper: it is off the gather's critical path, never built for a no-grad forward (eval),
                   and built once per step, not per micro-batch. Per-expert params of one module are
                   published together: one copy of their bytes and one of their scales into the module's
                   `[E, out, in]` weight (`weight_sites.publish_experts`), no per-expert loop
`BlockwiseFP8Storage` (fp8 `blockwise`, blockwise_storage.py): the per-tensor strategy with each param's
    128x128 block grid for its scale slots: block amaxes of the shards all-reduced (MAX), bytes gathered.
`StagedQuantizedStorage` (mxfp8, nvfp4): 1-D block scales cannot be cut across shards, so (as Megatron's
    `reuse_grad_buf_for_mxfp8_param_ag`) ranks stage `master` cast to the param dtype in a staging buffer,
    aliased on the grad buffer (`aliased=True`) or its own memory, gather it, and every rank quantizes the
    gathered values itself, rowwise and columnwise, with ONE quantize call per param (a single grouped
    `[E, out, in]` weight is one call, seed 000). Then only the aliased staging slice is zeroed. Staging
    after every `zero_grad_buffer` and before the deferred gather is `DistributedModel`'s job (#4987).

What is quantized is always the master cast to the param dtype: the value the model would hold and quantize
without param gather. So gather ON equals OFF bitwise for mxfp8, nvfp4 and tensorwise (tensorwise's amax of
the shards is the amax of the whole weight); delayed differs only in how often amaxes enter the history
(once per step here, once per micro-batch forward there).

Checkpoints save, under a quantized param's name, its master cast to the param dtype (what the run would
save without param gather); `matches_master` is the validation check (live bytes == the recipe's
quantization of the master).
"""

from __future__ import annotations

import weakref
from abc import abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import nn

from moectl.core.arith import round_up
from trainer.parallel import comm
from trainer.distributed.param_storage import AliasedStagingStorage, ParamStorage, Shard
from trainer.parallel.groups import Group
from trainer.distributed.weight_sites import WeightSite, live, placeholder, publish, publish_experts
from trainer.precision import QuantizedData, QuantizedTensor, Recipe, quantize
from trainer.kernels.fp8_scale import inverse, scale_from_amax
from trainer.precision.formats import fp8_format
from trainer.precision.recipes import DelayedRecipe
from trainer.precision.recipes.delayed import AmaxHistory
from trainer.precision.shard import quantize_shard, shard_amax

if TYPE_CHECKING:
    from trainer.distributed.bucket import Bucket

STORAGE_ATTR = "low_precision_storage"


def quantized_storage_of(param: torch.Tensor) -> Optional["QuantizedParamStorage"]:
    """The quantized storage holding `param`'s values, or None for a high-precision param."""
    ref = getattr(param, STORAGE_ATTR, None)
    return None if ref is None else ref()


def _qt_tensors(qt: QuantizedTensor) -> list[torch.Tensor]:
    return [t for q in (qt.rowwise, qt.columnwise) if q is not None for t in q.tensors().values()]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu()


def same_quantized(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    """Bitwise equality of every copy (data and scales) of two quantized tensors."""
    ta, tb = _qt_tensors(a), _qt_tensors(b)
    return a.shape == b.shape and len(ta) == len(tb) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bytes(x), _bytes(y)) for x, y in zip(ta, tb)
    )


class QuantizedParamStorage(ParamStorage):
    """What both strategies share: init copies, placeholders, sites, digests (see the module docstring)."""

    needs_initial_sync = True

    def __init__(self, recipe: Recipe, sites: dict[nn.Parameter, WeightSite]) -> None:
        self.recipe = recipe
        self.sites = sites
        #: high-precision init values (CPU) until the optimizer has built its masters
        self.init_values: dict[nn.Parameter, torch.Tensor] = {}

    def site(self, param: nn.Parameter) -> WeightSite:
        s = self.sites.get(param)
        if s is None:  # a bare param (benchmarks): it holds its own quantized value
            s = self.sites[param] = WeightSite(param, None, self.recipe)
        return s

    def storage_dtype(self, param: nn.Parameter) -> torch.dtype:
        return torch.uint8  # the buffer key's "param dtype": quantized storage

    def _take_init(self, param: nn.Parameter) -> None:
        """Keep the init values on the CPU and leave the param a placeholder: no high-precision copy stays."""
        if param.dim() < 2:
            raise ValueError(f"only weight matrices can be stored quantized, got shape {tuple(param.shape)}")
        site = self.site(param)
        if site.recipe is not None and site.recipe.name != self.recipe.name:
            raise ValueError(f"a {site.recipe.name} layer's weight in {self.recipe.name} storage")
        self.init_values[param] = param.detach().to("cpu", copy=True)
        param.data = placeholder(param)
        # A weak reference: the param is also held from C++ (autograd), where the garbage collector does not
        # look, so a strong one made param -> storage -> buffers -> model -> param a cycle never freed.
        setattr(param, STORAGE_ATTR, weakref.ref(self))

    def init_source(self, param: nn.Parameter) -> torch.Tensor:
        try:
            return self.init_values[param]
        except KeyError:
            raise RuntimeError(
                "the init values of a quantized param are gone (masters are built once, from the init values, "
                "never from dequantized params)"
            ) from None

    def release_init_source(self, param: nn.Parameter) -> None:
        self.init_values.pop(param, None)

    def replica_tensors(self, param: nn.Parameter) -> list[torch.Tensor]:
        # Replicas must build masters from the same values; the placeholder holds nothing to agree on.
        return [self.init_values[param]] if param in self.init_values else []

    def live(self, param: nn.Parameter) -> Optional[QuantizedTensor]:
        """The param's current quantized value (None before the first gather)."""
        return live(self.site(param))

    def digest_tensors(self, param: nn.Parameter) -> list[torch.Tensor]:
        qt = self.live(param)
        if qt is None:
            raise RuntimeError("a quantized param has no value yet: the optimizer gathers it when it is built")
        return _qt_tensors(qt)

    @abstractmethod
    def expected(self, param: nn.Parameter, master: torch.Tensor) -> QuantizedTensor:
        """The recipe's quantization of `master` (the param's full fp32 master) as this storage makes it."""

    def matches_master(self, param: nn.Parameter, master: torch.Tensor) -> bool:
        """Whether the live quantized param is bitwise the recipe's quantization of `master`."""
        qt = self.live(param)
        return qt is not None and same_quantized(qt, self.expected(param, master.to(qt.device)))


# ------------------------------------------------------------------------------------------------ per-tensor
@dataclass(frozen=True)
class _Whole:
    """A param published on its own: bucket elements [start, end), scale slots [slot, slot + slots)."""

    param: nn.Parameter
    start: int
    end: int
    slot: int
    slots: int


@dataclass(frozen=True)
class _ExpertRun:
    """Consecutive per-expert params of one module in one bucket, evenly spaced: published together.

    Param k of the run starts at bucket element `start + k * stride`, holds expert `experts[k]`, and its
    scales are slots `slot + k * slots` onwards (per-tensor: one each; blockwise: its block grid).
    """

    site: WeightSite
    experts: torch.Tensor  # int64 [n], on the buffer's device
    start: int
    stride: int
    slot: int
    slots: int = 1

    @property
    def count(self) -> int:
        return self.experts.numel()


@dataclass
class _RunBuilder:
    """An `_ExpertRun` while the plan is being built."""

    site: WeightSite
    experts: list[int]
    start: int
    stride: int  # 0 until the run has two params
    slot: int
    slots: int = 1  # scale slots of each param of the run

    def extends(self, site: WeightSite, start: int, slot: int) -> bool:
        """Whether a param of `site` at bucket element `start`, scale slot `slot`, continues this run."""
        if site.module is not self.site.module or slot != self.slot + len(self.experts) * self.slots:
            return False
        if len(self.experts) == 1:
            return start > self.start
        return start == self.start + len(self.experts) * self.stride

    def add(self, site: WeightSite, start: int) -> None:
        if len(self.experts) == 1:
            self.stride = start - self.start
        self.experts.append(site.expert)  # type: ignore[arg-type]

    def build(self, device: torch.device) -> _ExpertRun:
        stride = self.stride or self.site.param.numel()
        return _ExpertRun(self.site, torch.tensor(self.experts, dtype=torch.int64, device=device), self.start,
                          stride, self.slot, self.slots)  # fmt: skip


@dataclass(frozen=True)
class _BucketPlan:
    """How a bucket's gathered bytes become published weights (fixed by the layout; built once)."""

    whole: tuple[_Whole, ...]
    runs: tuple[_ExpertRun, ...]
    slot_of: dict[nn.Parameter, tuple[int, int]]  # param -> (first slot, slots) in the bucket's scale vector
    total_slots: int  # length of that vector, gaps included


#: A published whole param's decode scale is a view into its bucket's scale vector, handed to cuBLASLt as
#: the GEMM's scale pointer: it must start on 16 bytes (4 fp32 slots), or `torch._scaled_mm` fails with
#: CUBLAS_STATUS_NOT_SUPPORTED (seen on an H200). Per-expert runs are copied out by publish_experts instead.
SCALE_SLOT_ALIGN = 4


class PerTensorFP8Storage(QuantizedParamStorage):
    """FP8 bytes in a uint8 buffer, per-tensor scales agreed over the ranks (see the module docstring)."""

    needs_scales = True
    #: the weight scheme's kind this storage shards (a subclass for 128x128 blocks: blockwise_storage.py)
    SCHEME_KIND = "tensor"

    def __init__(self, recipe: Recipe, sites: dict[nn.Parameter, WeightSite]) -> None:
        super().__init__(recipe, sites)
        self.scheme = recipe.weight_scheme()
        if self.scheme.kind != self.SCHEME_KIND:
            raise ValueError(f"{recipe.name}: {type(self).__name__} needs {self.SCHEME_KIND} weight scales, "
                             f"not {self.scheme.describe()}")  # fmt: skip
        self.fmt = fp8_format(self.scheme.fmt)
        self.delayed = isinstance(recipe, DelayedRecipe)
        #: encode scale per param (fp32 `[slots]`) from the last prepare_stage
        self.scales: dict[nn.Parameter, torch.Tensor] = {}
        #: the encode scales each bucket's staged bytes were encoded with, one flat fp32 vector per bucket
        #: (every param's slots in bucket order, see `_BucketPlan.slot_of`): they travel with the bytes
        self.staged_scales: dict["Bucket", torch.Tensor] = {}
        #: the encode scales of the values the model holds now, per bucket (set by post_gather)
        self.live_scales: dict["Bucket", torch.Tensor] = {}
        self._plans: dict["Bucket", _BucketPlan] = {}
        self._bucket_of: dict[nn.Parameter, "Bucket"] = {}
        #: delayed scaling: one weight amax history per site owner (module), one entry per expert
        self.histories: dict[Any, AmaxHistory] = {}
        #: delayed scaling restored from a checkpoint: per owner, the encode scales that quantized the saved
        #: masters; the next staging (the load's) uses them instead of recording the same amax twice
        self.pending_scales: dict[Any, torch.Tensor] = {}

    @property
    def key(self) -> str:
        return f"fp8_per_tensor:{self.recipe.name}"

    def buffer_dtype(self, param: nn.Parameter) -> torch.dtype:
        return torch.uint8

    def slots(self, param: nn.Parameter) -> int:
        """Per-tensor scales of `param`: one per expert of a grouped `[E, out, in]` weight, else one."""
        return param.shape[0] if param.dim() == 3 else 1

    def scale_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        """The shape of `param`'s decode scales in its QuantizedTensor (its `slots` of them)."""
        return tuple(param.shape[:-2])

    def piece_amax(self, param: nn.Parameter, x: torch.Tensor, first: int) -> torch.Tensor:
        """fp32 `[slots]`: the amax of each slot over `x`, the run of `param` from element `first`."""
        k = self.slots(param)
        return shard_amax(x, first, param.numel() // k, k)

    def quantize_piece(self, param: nn.Parameter, x: torch.Tensor, first: int, scale: torch.Tensor) -> torch.Tensor:
        """The FP8 values of `x`, the run of `param` from element `first`, under the encode scales `scale`."""
        return quantize_shard(x, first, param.numel() // self.slots(param), scale, self.scheme)

    def bind(self, param: nn.Parameter, view: torch.Tensor) -> None:
        self._take_init(param)  # the bytes arrive with the optimizer's first stage + gather

    # ---- scales -------------------------------------------------------------------------------------
    def prepare_stage(self, shards: Sequence[Shard]) -> None:
        """Local amaxes of every param's shard pieces, one MAX all-reduce per process group, then scales."""
        groups: dict[tuple[int, ...], tuple[Group, list[nn.Parameter]]] = {}
        for bucket, _, _, _ in shards:
            entry = groups.setdefault(bucket.group.ranks, (bucket.group, []))
            entry[1].extend(bucket.params)
        amax: dict[nn.Parameter, torch.Tensor] = {}
        for group, params in groups.values():
            offsets, n = {}, 0
            for p in params:
                offsets[p] = n
                n += self.slots(p)
            device = params[0].device
            local = torch.zeros(n, dtype=torch.float32, device=device)
            for bucket, lo, hi, master in shards:
                if bucket.group.ranks != group.ranks:
                    continue
                for pc in bucket.pieces(lo, hi):
                    p, k = pc.param, self.slots(pc.param)
                    x = master[pc.bucket_lo - lo:pc.bucket_hi - lo].to(p.dtype)  # what the model quantizes
                    part = self.piece_amax(p, x, pc.param_lo)
                    o = offsets[p]
                    torch.maximum(local[o:o + k], part, out=local[o:o + k])
            comm.all_reduce(local, group, op=torch.distributed.ReduceOp.MAX)  # the one all-reduce of the group
            for p in params:
                amax[p] = local[offsets[p]:offsets[p] + self.slots(p)]
        self.scales = self._scales_from(amax)

    def _scales_from(self, amax: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        if not self.delayed:
            return {p: scale_from_amax(a, self.fmt.max, self.scheme.pow2) for p, a in amax.items()}
        # Delayed: quantize with the scale from past amaxes, then record this amax (per owner = module,
        # one entry per expert), as the layer's own weight history does once per forward without gather.
        by_owner: dict[Any, list[nn.Parameter]] = {}
        for p in amax:
            by_owner.setdefault(self.site(p).owner, []).append(p)
        out = {}
        for owner, params in by_owner.items():
            params = self.owner_params(owner, params)
            vec = torch.cat([amax[p] for p in params])
            hist = self.owner_history(owner, params)
            pending = self.pending_scales.pop(owner, None)
            if pending is not None:  # the load's staging of restored masters: as the saved run staged them
                scale = pending.to(vec.device, torch.float32).reshape(-1)
            else:
                scale = hist.current_scale(vec.device).clone().reshape(-1)
                hist.record(vec.reshape(hist.shape))
            at = 0
            for p in params:
                out[p] = scale[at:at + self.slots(p)]
                at += self.slots(p)
        return out

    def owner_params(self, owner: Any, params: Optional[list[nn.Parameter]] = None) -> list[nn.Parameter]:
        """The params sharing `owner`'s delayed history (all of them when `params` is None), in its entries'
        order: a per-expert layer's experts by index."""
        if params is None:
            params = [p for p in self.sites if self.site(p).owner is owner]
        site0 = self.site(params[0])
        if site0.expert is not None:
            params = sorted(params, key=lambda q: self.site(q).expert)  # type: ignore[arg-type, return-value]
            if len(params) != site0.num_experts:
                raise ValueError("delayed scaling: every expert of a per-expert layer must be in one storage")
        return params

    def owner_history(self, owner: Any, params: list[nn.Parameter]) -> AmaxHistory:
        """The delayed history `owner_params` share, made on first use: one entry per expert, else a scalar."""
        if owner not in self.histories:
            per_expert = self.site(params[0]).expert is not None or params[0].dim() == 3
            shape = (sum(self.slots(p) for p in params),) if per_expert else ()
            length = self.recipe.history_len  # type: ignore[attr-defined]
            self.histories[owner] = AmaxHistory(length, self.fmt.max, shape)
        return self.histories[owner]

    # ---- staging and post-processing ----------------------------------------------------------------
    def stage(self, bucket: "Bucket", lo: int, hi: int, master: torch.Tensor) -> None:
        missing = [p for p in bucket.params if p not in self.scales]
        if missing:
            raise RuntimeError("per-tensor FP8 staging before prepare_stage agreed on the scales")
        for pc in bucket.pieces(lo, hi):
            p = pc.param
            x = master[pc.bucket_lo - lo:pc.bucket_hi - lo].to(p.dtype)
            q = self.quantize_piece(p, x, pc.param_lo, self.scales[p])
            bucket.param_data[pc.bucket_lo:pc.bucket_hi].copy_(q.view(torch.uint8))
        # One snapshot of every param's scales, in the plan's slot order (one kernel, not one per param); the
        # alignment gaps hold 1 (a finite reciprocal, never read).
        plan = self._plan(bucket)
        pieces, at = [], 0
        for p in bucket.params:
            slot, k = plan.slot_of[p]
            if slot > at:
                pieces.append(torch.ones(slot - at, dtype=torch.float32, device=master.device))
            pieces.append(self.scales[p].reshape(-1).to(torch.float32))
            at = slot + k
        self.staged_scales[bucket] = torch.cat(pieces)

    def _plan(self, bucket: "Bucket") -> _BucketPlan:
        """The bucket's publication plan: whole params, and runs of evenly spaced per-expert params of one
        module (the buffer lays a module's experts out back to back, in expert order: where its grouped weight
        would lie)."""
        plan = self._plans.get(bucket)
        if plan is not None:
            return plan
        whole: list[_Whole] = []
        runs: list[_RunBuilder] = []
        slot_of: dict[nn.Parameter, tuple[int, int]] = {}
        slot = 0
        for p in bucket.params:
            start, end = bucket.param_ranges[p]
            k = self.slots(p)
            self._bucket_of[p] = bucket
            site = self.site(p)
            if site.module is None or site.expert is None:
                slot = round_up(slot, SCALE_SLOT_ALIGN)
                slot_of[p] = (slot, k)
                whole.append(_Whole(p, start, end, slot, k))
            elif runs and runs[-1].extends(site, start, slot):
                runs[-1].add(site, start)
            else:
                runs.append(_RunBuilder(site, [site.expert], start, 0, slot, k))
            slot_of.setdefault(p, (slot, k))
            slot += k
        device = bucket.param_data.device
        plan = _BucketPlan(tuple(whole), tuple(r.build(device) for r in runs), slot_of, slot)
        self._plans[bucket] = plan
        return plan

    def post_gather(self, bucket: "Bucket") -> None:
        """Publish the gathered bytes rowwise (views, no copy) with their decode scales; see the docstring."""
        plan = self._plan(bucket)
        encode = self.staged_scales[bucket]
        decode = inverse(encode)  # every param's decode scales at once
        buf = bucket.param_data
        for w in plan.whole:
            p = w.param
            data = buf[w.start:w.end].view(self.fmt.dtype).view(p.shape)  # no copy: the gathered bytes
            scale_inv = decode[w.slot:w.slot + w.slots].reshape(self.scale_shape(p))
            publish(self.site(p), QuantizedTensor(self.scheme, p.shape, p.dtype, rowwise=QuantizedData(data, scale_inv),
                                                  recipe=self.recipe.name))  # fmt: skip
        for run in plan.runs:
            shape = run.site.param.shape
            if run.stride < shape.numel():
                raise AssertionError("per-expert params of one run overlap in the buffer")
            # the run's params as one [n, out, in] view of the gathered bytes (param k at start + k * stride)
            data = buf.as_strided((run.count, *shape), (run.stride, shape[-1], 1),
                                  buf.storage_offset() + run.start).view(self.fmt.dtype)  # fmt: skip
            scales = decode[run.slot:run.slot + run.count * run.slots]
            publish_experts(run.site, run.experts, data, scales.reshape(run.count, *self.scale_shape(run.site.param)),
                            self.scheme, self.recipe.name)  # fmt: skip
        self.live_scales[bucket] = encode

    def live_scale(self, param: nn.Parameter) -> torch.Tensor:
        """The encode scale(s) `[slots]` of the values `param` holds now (after its first gather)."""
        bucket = self._bucket_of[param]
        slot, k = self._plans[bucket].slot_of[param]
        return self.live_scales[bucket][slot:slot + k]

    def digest_tensors(self, param: nn.Parameter) -> list[torch.Tensor]:
        """The rowwise bytes and decode scale: all replicas must agree on. The columnwise copy is their exact
        transpose, built lazily (maybe not yet), so it adds nothing to compare."""
        qt = self.live(param)
        if qt is None:
            raise RuntimeError("a quantized param has no value yet: the optimizer gathers it when it is built")
        return list(qt.copy("rowwise").tensors().values())

    def matches_master(self, param: nn.Parameter, master: torch.Tensor) -> bool:
        """As the base class, with the columnwise copy compared too: the cached one if built, else one built
        now on a shallow copy (the live tensor is left as it is)."""
        qt = self.live(param)
        if qt is None:
            return False
        if qt.columnwise is None:
            qt = replace(qt).with_columnwise()
        return same_quantized(qt, self.expected(param, master.to(qt.device)))

    def expected(self, param: nn.Parameter, master: torch.Tensor) -> QuantizedTensor:
        """`master` cast to the param dtype, quantized with the live encode scales: for tensorwise these are
        FP8_MAX / amax(master) (what `recipe.quantize_weight` computes), for delayed the history's."""
        if not self.delayed:
            return self.recipe.quantize_weight(master.to(param.dtype), rowwise=True, columnwise=True)
        encode = self.live_scale(param).reshape(param.shape[:-2])
        return quantize(master.to(param.dtype), self.scheme, rowwise=True, columnwise=True, encode_scale=encode,
                        recipe=self.recipe.name)  # fmt: skip


# ------------------------------------------------------------------------------------------------ staged
class StagedQuantizedStorage(QuantizedParamStorage, AliasedStagingStorage):
    """Stage high precision, gather, quantize locally (mxfp8, nvfp4; see the module docstring)."""

    def __init__(self, recipe: Recipe, sites: dict[nn.Parameter, WeightSite], aliased: bool = True) -> None:
        QuantizedParamStorage.__init__(self, recipe, sites)
        AliasedStagingStorage.__init__(self, staging_dtype=None)  # stage in the param dtype
        self.aliases_grad = aliased

    @property
    def key(self) -> str:
        return f"staged:{self.recipe.name}:{'aliased' if self.aliases_grad else 'own'}"

    def bind(self, param: nn.Parameter, view: torch.Tensor) -> None:
        self._take_init(param)  # the staging slice is filled by the optimizer's first stage

    def write_param(self, param: nn.Parameter, gathered: torch.Tensor) -> None:
        """Quantize the gathered values of `param` (one call, also for a whole [E, out, in]) and publish them."""
        qt = self.recipe.quantize_weight(gathered.view(param.shape), rowwise=True, columnwise=True)
        publish(self.site(param), qt)

    def post_gather(self, bucket: "Bucket") -> None:
        for param in bucket.params:
            start, end = bucket.param_ranges[param]
            self.write_param(param, bucket.param_data[start:end])
        if self.aliases_grad:
            # Only this bucket's staging slice: the rest of the grad memory may hold other buckets' staged
            # values, or their grads (bf16 staging spans the first half of fp32 grad memory).
            bucket.param_data.zero_()

    def expected(self, param: nn.Parameter, master: torch.Tensor) -> QuantizedTensor:
        return self.recipe.quantize_weight(master.to(param.dtype), rowwise=True, columnwise=True)
