"""`moectl bench param-gather`: the param all-gather of one step through moectl's buckets, against raw NCCL.

Run it on N >= 2 GPUs (`moectl bench param-gather --nproc-per-node 2`, or
`torchrun --nproc-per-node 2 -m moectl bench param-gather`). Two tables:

1. Gather. The parameters of a `param_mix.MixShape` (`--mix`: "default", 803.5M with a 16.7% embedding +
   head; "large-moe", 2.0B with 3.3%, a real large MoE's share) live in moectl's buffers
   (`DistributedModel`, distributed optimizer, default 40M-element buckets); every iteration the optimizer's
   write-back stages this rank's shard of every bucket (untimed), then one version gathers them all:

       moectl sync                  `start_param_sync(force_sync=True)`: every bucket's all-gather in one
                                    coalesced collective, then each group waited and post-processed (the
                                    path of overlap off, eval, checkpoint; the default)
       moectl sync, per bucket      the same with coalescing off: one blocking all-gather per bucket group
       moectl async                 every group dispatched (async all-gathers in flight together), then
                                    waited and post-processed in forward order (the overlap pre-hooks'
                                    path, without compute)
       raw, one call                one `all_gather_into_tensor` of the same total bytes (in place)
       raw, per bucket              the same calls as moectl makes, back to back, without moectl around them
       raw, per bucket, coalesced   those calls inside one `_coalescing_manager` (one NCCL group)
       columnwise build (impl)      fp8 only, not a gather: building every FP8 weight's columnwise copy
                                    (the transpose the backward builds at its first use, see
                                    `quantized_storage.py`) from the gathered bytes, with eager torch and
                                    (CUDA) the Triton kernel at its default tile and a 128x128 one;
                                    GB = bytes read + written

   Reported per version: median time (the slowest rank's median), bytes gathered (the whole output),
   algorithm bandwidth (bytes / time) and bus bandwidth (algbw * (n-1)/n, nccl-tests' convention for
   all-gather), the ratio to the raw one-call time (target, issue 5: moectl within 1.1x of raw) and, for
   fp8 and mxfp8, the ratio to the bf16 row of the same name (`vs_bf16`; target, issue 6: fp8 "moectl sync"
   <= 0.6x of bf16's). Rows per storage format (`FORMATS`): bf16; fp8 (tensorwise param gather: the
   attention and expert weights as FP8 bytes in uint8 buffers, the rest bf16); mxfp8 (param gather through
   the bf16 staging buffer aliased on the grad buffer, every rank quantizing after the gather). Each row
   also reports bytes gathered per param, over all params and over the quantized ones (`qbytes_per_param`:
   target <= 1.02 for fp8; the gain of the format is there, the embedding and head stay bf16). Before
   timing, each format checks that the coalesced sync gives bitwise the per-bucket sync's live values.

2. Step. A real GPT-MoE (bf16, `StepShape`) trains on every rank with the distributed optimizer, timed per
   step (host clock around a synchronised step) in interleaved rounds: overlap on (grad reduce in the
   backward, param gather in the next forward's pre-hooks), overlap off, and compute only (overlap off with
   moectl's collectives replaced by no-ops: the same kernels, no communication). Exposed communication
   = (step - compute only) / step. Target: under 10% with overlap on.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from moectl.bench.param_mix import MixShape, build_params, device_meta, mix_shape

# torch 2.13 names it all_gather_single (and deprecates the old name); 2.11 has only all_gather_into_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class GatherFormat:
    """How params are stored and gathered: their dtype, and the buffer storage strategy (None: high precision)."""

    params_dtype: torch.dtype
    storage: Optional[Callable[[], Any]] = None  # () -> StorageSpec for DistributedModel (a recipe's storage)
    note: str = ""


def _param_gather(recipe: str) -> Callable[[], Any]:
    """() -> the StorageSpec of `recipe`'s low-precision param gather over `build_params`' bare params:
    attention and expert weights quantized, the rest bf16 (trainer/distributed/param_gather.py)."""

    def spec() -> Any:
        from moectl.core.config.schema import MixedPrecisionConfig
        from trainer.distributed.param_gather import storage_by_name
        from trainer.precision import get_recipe

        mp = MixedPrecisionConfig(bf16=True, fp8="e4m3", fp8_recipe=recipe,  # type: ignore[arg-type]
                                  fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=recipe == "mxfp8")
        return storage_by_name(get_recipe(mp), mp)  # type: ignore[arg-type]

    return spec


FORMATS: dict[str, GatherFormat] = {
    "bf16": GatherFormat(torch.bfloat16, None, "bf16 params in the param buffer (2 B/param gathered)"),
    "fp8": GatherFormat(torch.bfloat16, _param_gather("tensorwise"),
                        "fp8 tensorwise param gather: FP8 bytes of the attention and expert weights (1 B/param; "
                        "scales from one amax all-reduce, untimed with the staging), the rest bf16; "
                        "post-processing (views, decode scales, per-expert publication) timed; the columnwise "
                        "copies are built at their first backward use: 'columnwise build' rows"),
    "mxfp8": GatherFormat(torch.bfloat16, _param_gather("mxfp8"),
                          "mxfp8 param gather: bf16 staged in the grad buffer (2 B/param gathered), "
                          "post-processing (quantize rowwise + columnwise on every rank) timed"),
}


@dataclass(frozen=True)
class StepShape:
    """The GPT-MoE trained in the step table (~490M params, 2 x 2 x 2048 tokens per rank and step)."""

    layers: int = 8
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    experts: int = 16
    expert_ffn: int = 1024
    topk: int = 2
    vocab: int = 32768
    seq: int = 2048
    micro_batch: int = 2
    n_micro: int = 2

    @staticmethod
    def quick() -> "StepShape":
        return StepShape(layers=2, hidden=32, heads=2, kv_heads=1, experts=4, expert_ffn=16, vocab=256, seq=32,
                         micro_batch=2, n_micro=2)


@dataclass
class GatherBenchConfig:
    device: Optional[str] = None  # None: this rank's GPU when CUDA is there
    shape: MixShape = field(default_factory=MixShape.default)
    mix: str = "default"  # the name of `shape` in `param_mix.MIXES` (reported)
    formats: tuple[str, ...] = ("bf16", "fp8", "mxfp8")
    bucket_size: Optional[int] = None  # None: moectl's default (max(40M, 1M * dp) elements)
    warmup: int = 3
    rounds: int = 5
    per_round: int = 4
    step: Optional[StepShape] = field(default_factory=StepShape)  # None: skip the step table
    step_rounds: int = 4
    step_per_round: int = 3

    @staticmethod
    def for_mix(mix: str = "default", device: Optional[str] = None) -> "GatherBenchConfig":
        return GatherBenchConfig(device=device, shape=mix_shape(mix), mix=mix)

    @staticmethod
    def quick(device: Optional[str] = None, mix: str = "default") -> "GatherBenchConfig":
        return GatherBenchConfig(device=device or "cpu", shape=mix_shape(mix, quick=True), mix=mix, warmup=1,
                                 rounds=2, per_round=2, bucket_size=20_000, step=StepShape.quick(), step_rounds=1,
                                 step_per_round=2)  # fmt: skip


@dataclass
class GatherBenchResult:
    meta: dict[str, Any]
    gather_rows: list[dict[str, Any]]
    step_rows: list[dict[str, Any]]
    notes: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------------ timing
def _sync_all(device: torch.device) -> None:
    """Line the ranks up (a tiny all-reduce), then drain the device: each timed call starts together."""
    tick = torch.zeros(1, device=device)
    dist.all_reduce(tick)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_once(run: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) * 1e3


def _interleaved(cases: dict[str, tuple[Callable[[], object], Callable[[], object]]], device: torch.device,
                 warmup: int, rounds: int, per_round: int) -> dict[str, float]:
    """Median ms of each `(setup, run)` case (setup untimed), in interleaved rounds; the slowest rank's median."""
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(warmup):
        for setup, run in cases.values():
            setup()
            _sync_all(device)
            _timed_once(run, device)
    for _ in range(rounds):
        for name, (setup, run) in cases.items():
            for i in range(per_round + 1):  # the first call of a round is untimed (allocator, caches)
                setup()
                _sync_all(device)
                ms = _timed_once(run, device)
                if i:
                    samples[name].append(ms)
    medians = torch.tensor([statistics.median(v) for v in samples.values()], dtype=torch.float64, device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(samples, medians.tolist()))


# ------------------------------------------------------------------------------------------------ gather
def _live_values(dm: Any) -> list[torch.Tensor]:
    """Copies of what every param holds live (a quantized param's rowwise bytes and scales; else the param)."""
    out = []
    for buf in dm.buffers:
        for p in buf.params:
            out += [t.detach().clone() for t in buf.storage.digest_tensors(p)]
    return out


def coalesced_equals_per_bucket(dm: Any, stage: Callable[[], None]) -> bool:
    """Whether a coalesced synchronous gather leaves bitwise the live values a per-bucket one does."""
    saved = dm.coalesce_sync_gather
    try:
        results = []
        for coalesce in (False, True):
            dm.coalesce_sync_gather = coalesce
            stage()
            dm.start_param_sync(force_sync=True)
            results.append(_live_values(dm))
    finally:
        dm.coalesce_sync_gather = saved
    a, b = results
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _columnwise_cases(dm: Any, device: torch.device) -> tuple[dict[str, Callable[[], object]], int]:
    """fp8 only: build every quantized param's columnwise copy from its live rowwise bytes (what the first
    backward after a gather does), per transpose implementation; and the bytes that moves (read + write)."""
    from dataclasses import replace

    from trainer.kernels import fp8_transpose_triton as ft
    from trainer.precision.blocks import transposed

    lives = [buf.storage.live(p) for buf in dm.buffers if buf.storage.needs_initial_sync for p in buf.params]
    lives = [qt for qt in lives if qt is not None and qt.scheme.transposable]
    if not lives:
        return {}, 0
    moved = 2 * sum(qt.rowwise.data.numel() for qt in lives)
    impls: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"torch": ft.transpose_torch}
    if device.type == "cuda" and ft.triton_available():  # the default tile (what training runs), and a larger one
        for tile in (ft.DEFAULT_TILE, (128, 128, 8)):
            impls[f"triton {tile[0]}x{tile[1]}"] = lambda x, t=tile: ft.transpose_triton(x, t)  # type: ignore[misc]
    for qt in lives:  # every implementation, and the storage's own lazy build, must equal the eager copy
        ref = transposed(qt.rowwise.data).view(torch.uint8)
        built = [fn(qt.rowwise.data) for fn in impls.values()]
        built.append(replace(qt, columnwise=None).with_columnwise().copy("columnwise").data)
        if not all(torch.equal(b.view(torch.uint8), ref) for b in built):
            raise AssertionError("a columnwise build differs from the eager transpose of the rowwise bytes")

    def build(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        return lambda: [fn(qt.rowwise.data) for qt in lives]

    return {f"columnwise build ({name})": build(fn) for name, fn in impls.items()}, moved


def gather_rows(cfg: GatherBenchConfig, fmt_name: str, device: torch.device) -> tuple[list[dict[str, Any]], bool]:
    """The rows of one format, and whether its coalesced sync equalled the per-bucket one bitwise."""
    from moectl.core.config.schema import OptimizerConfig, ParallelConfig
    from trainer.distributed import DistributedModel
    from trainer.parallel.groups import build_parallel_state
    from trainer.optim.distributed_optimizer import DistributedOptimizer

    fmt = FORMATS[fmt_name]
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build_params(cfg.shape, device, fmt.params_dtype, seed=1)
    dm = DistributedModel(model, ParallelConfig(bucket_size=cfg.bucket_size), build_parallel_state(1),
                          storage=fmt.storage() if fmt.storage else None)
    opt = DistributedOptimizer(dm, OptimizerConfig())
    buckets = [b for buf in dm.buffers for b in buf.buckets]
    nbytes = sum(b.param_data.numel() * b.param_data.element_size() for b in buckets)
    qbufs = [buf for buf in dm.buffers if buf.storage.needs_initial_sync]  # quantized storage
    qparams = sum(p.numel() for buf in qbufs for p in buf.params)
    qbytes = sum(buf.param_data.numel() * buf.param_data.element_size() for buf in qbufs)
    # raw gathers move the same bytes (buffers of several dtypes: uint8 fp8 bytes beside bf16)
    raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
    shard = raw.numel() // world
    raw_in = raw[rank * shard:(rank + 1) * shard]
    raw_buckets, at = [], 0
    for b in buckets:
        n = b.numel * b.param_data.element_size()
        out = raw[at:at + n]
        raw_buckets.append((out, out[rank * (n // world):(rank + 1) * (n // world)]))
        at += n

    def stage() -> None:
        for g in opt.groups:
            g.stage()

    def ours_sync(coalesce: bool) -> Callable[[], None]:
        def run() -> None:
            dm.coalesce_sync_gather = coalesce
            dm.start_param_sync(force_sync=True)

        return run

    def ours_async() -> None:
        for g in dm.forward_order:
            g.dispatch()
        for g in dm.forward_order:
            g.wait()
            g.post_process()

    def raw_per_bucket() -> None:
        for out, inp in raw_buckets:
            _all_gather(out, inp)

    def raw_coalesced() -> None:
        from torch.distributed.distributed_c10d import _coalescing_manager

        with _coalescing_manager(dist.group.WORLD, async_ops=True) as cm:
            for out, inp in raw_buckets:
                _all_gather(out, inp, async_op=True)
        cm.wait()

    def nothing() -> None:
        return None

    equal = coalesced_equals_per_bucket(dm, stage)
    cases: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "moectl sync": (stage, ours_sync(True)),
        "moectl sync, per bucket": (stage, ours_sync(False)),
        "moectl async": (stage, ours_async),
        "raw, one call": (nothing, lambda: _all_gather(raw, raw_in)),
        "raw, per bucket": (nothing, raw_per_bucket),
        "raw, per bucket, coalesced": (nothing, raw_coalesced),  # one dtype (uint8): coalesces on gloo too
    }
    builds, moved = _columnwise_cases(dm, device)
    cases.update({name: (nothing, fn) for name, fn in builds.items()})
    ms = _interleaved(cases, device, cfg.warmup, cfg.rounds, cfg.per_round)
    dm.coalesce_sync_gather = True
    rows = []
    for name, t in ms.items():
        gathered = name not in builds
        size = nbytes if gathered else moved
        algbw = size / (t * 1e-3) / 1e9
        rows.append({
            "format": fmt_name, "name": name, "ms": t, "gbytes": size / 1e9, "buckets": len(buckets),
            "bytes_per_param": nbytes / cfg.shape.numel(), "qbytes_per_param": qbytes / qparams if qparams else None,
            "algbw_gbps": algbw, "busbw_gbps": algbw * (world - 1) / world if gathered else None,
            "vs_raw": t / ms["raw, one call"] if gathered else None, "vs_bf16": None,
        })  # fmt: skip
    return rows, equal


# ------------------------------------------------------------------------------------------------ step
@contextlib.contextmanager
def no_collectives() -> Iterator[None]:
    """moectl's grad reduce, param gather and norm all-reduce as no-ops (compute-only timing)."""
    from trainer.parallel import comm

    saved = {k: getattr(comm, k) for k in ("reduce_scatter", "all_gather", "all_reduce")}
    try:
        for k in saved:
            setattr(comm, k, lambda *a, **kw: None)
        yield
    finally:
        for k, f in saved.items():
            setattr(comm, k, f)


def step_rows(cfg: GatherBenchConfig, device: torch.device) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from moectl.core.config.schema import ModelConfig, MoEConfig, OptimizerConfig, ParallelConfig
    from trainer.engine.distributed import DistributedEngine
    from trainer.parallel.groups import build_parallel_state
    from trainer.model import GPTMoE

    s = cfg.step
    if s is None:
        raise ValueError("step_rows needs cfg.step")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mcfg = ModelConfig(num_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads,
                       num_query_groups=s.kv_heads, seq_length=s.seq, vocab_size=s.vocab)
    moe = MoEConfig(num_experts=s.experts, router_topk=s.topk, ffn_hidden_size=s.expert_ffn)
    pstate = build_parallel_state(1)
    engines = {}
    base = GPTMoE(mcfg, moe, seed=3, params_dtype=dtype)  # one CPU init (seconds at this size), copied
    for name, overlap in (("overlap on", True), ("overlap off", False)):
        model = copy.deepcopy(base).to(device)
        pcfg = ParallelConfig(overlap_grad_reduce=overlap, overlap_param_gather=overlap, bucket_size=cfg.bucket_size)
        engines[name] = (model, DistributedEngine(model, pcfg, OptimizerConfig(lr=1e-4), pstate))
    g = torch.Generator(device=device).manual_seed(100 + dist.get_rank())
    batches = [torch.randint(0, s.vocab, (s.micro_batch, s.seq + 1), generator=g, device=device)
               for _ in range(s.n_micro)]

    def step(name: str) -> Callable[[], object]:
        model, engine = engines[name]

        def run() -> None:
            engine.zero_grad()
            for i, tokens in enumerate(batches):
                with engine.micro_batch(is_last=i == len(batches) - 1):
                    (model.loss(tokens[:, :-1], tokens[:, 1:]).total / len(batches)).backward()
            engine.step(1e-4)

        return run

    def compute_only() -> None:
        with no_collectives():
            step("overlap off")()

    def nothing() -> None:
        return None

    cases = {"overlap on": (nothing, step("overlap on")), "overlap off": (nothing, step("overlap off")),
             "compute only": (nothing, compute_only)}
    ms = _interleaved(cases, device, warmup=2, rounds=cfg.step_rounds, per_round=cfg.step_per_round)
    dmodel = engines["overlap on"][1].dmodel
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in dmodel.buffers)
    param_bytes = sum(b.param_data.numel() * b.param_data.element_size() for b in dmodel.buffers)
    n_params = sum(p.numel() for p in engines["overlap on"][0].parameters())
    rows = []
    for name, t in ms.items():
        exposed = t - ms["compute only"]
        rows.append({"name": name, "ms": t, "exposed_ms": exposed, "exposed_pct": 100 * exposed / t})
    info = {"step_params": n_params, "step_shape": asdict(s), "grad_reduce_gbytes": grad_bytes / 1e9,
            "param_gather_gbytes": param_bytes / 1e9, "tokens_per_rank": s.micro_batch * s.seq * s.n_micro}
    return rows, info


def run(cfg: GatherBenchConfig, device: torch.device, log: Callable[[str], None] = lambda s: None) -> GatherBenchResult:
    """Run on every rank of the initialised default group; every rank returns the same (max over ranks) numbers."""
    world = dist.get_world_size()
    meta = {**device_meta(device), "mix": cfg.mix, "shape": cfg.shape.to_json(), "bucket_size": cfg.bucket_size,
            "warmup": cfg.warmup, "rounds": cfg.rounds, "per_round": cfg.per_round, "coalesced_equals_per_bucket": {}}
    rows: list[dict[str, Any]] = []
    for fmt in cfg.formats:
        log(f"gather, {fmt}: {cfg.mix} mix, {cfg.shape.describe()} ...")
        fmt_rows, equal = gather_rows(cfg, fmt, device)
        rows += fmt_rows
        meta["coalesced_equals_per_bucket"][fmt] = equal
        gc.collect()  # the buffers' hooks hold the model in cycles: free its memory before the next part
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bf16 = {r["name"]: r["ms"] for r in rows if r["format"] == "bf16"}
    for r in rows:
        if r["format"] != "bf16" and r["name"] in bf16:
            r["vs_bf16"] = r["ms"] / bf16[r["name"]]
    notes = [f"{world} ranks; bus bandwidth = algbw * (n-1)/n; 'vs raw': against raw one-call all_gather_into_tensor "
             "of the same format; 'vs bf16': against bf16's row of the same name (target for fp8 moectl sync: "
             f"<= 0.6x); embedding + head are {100 * cfg.shape.embedding_head_share():.1f}% of the params "
             "(bf16 in every format)",
             "coalesced sync == per-bucket sync (bitwise, live values): "
             + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in meta["coalesced_equals_per_bucket"].items()),
             *(f"{k}: {FORMATS[k].note}" for k in cfg.formats)]  # fmt: skip
    if world == 1:
        notes.append("one rank: nothing moves, moectl skips the gather (run with --nproc-per-node 2 or more)")
    step: list[dict[str, Any]] = []
    if cfg.step is not None:
        log("step: building two GPT-MoE models (overlap on / off) ...")
        step, info = step_rows(cfg, device)
        meta["step"] = info
        on = next(r for r in step if r["name"] == "overlap on")
        notes.append(f"step: exposed communication with overlap on {on['exposed_pct']:.1f}% of the step "
                     f"(target < 10%); grads reduced {info['grad_reduce_gbytes']:.2f} GB fp32, params gathered "
                     f"{info['param_gather_gbytes']:.2f} GB per step")
    return GatherBenchResult(meta, rows, step, notes)
