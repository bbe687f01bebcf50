"""`moectl bench optimizer-step`: moectl's DistributedOptimizer step (dp=1) against `torch.optim.AdamW(fused=True)`.

Both step the same parameter set (`param_mix.MixShape`, 803.5M parameters by default) with fp32 grads:

    torch fused     `torch.optim.AdamW(fused=True)` over fp32 params with `.grad` set (decay / no-decay groups)
    moectl fp32     `DistributedModel` + `DistributedOptimizer` over fp32 params: the step the loop runs
                    (global grad norm and found-inf flag on the device, fused AdamW taking the clip as
                    `grad_scale` and the verdict as `found_inf`, the host read of the verdict after the
                    update is queued, the param sync's post-processing). The masters of fp32 params are
                    the param buffer itself: nothing is written back
    moectl bf16     the same with bf16 params (mixed precision: fp32 grads and separate fp32 masters; on
                    CUDA the update kernel writes the bf16 params itself, else staging writes them back)

and Muon's step on the same params (`optimizer_step_muon`: Muon + AdamW, bf16 params, Newton-Schulz in bf16
and in fp32, against torch fused AdamW's time; a FLOP rate instead of a byte floor),
plus the parts timed alone: the grad norm (`local_grad_sq` + the all-reduce into the device verdict, no
host read: the step reads it while the update runs), the update (the step's own kernels on the same
shards: `kernels/adamw_triton.py` on CUDA), and the bf16 write-back as staging runs it (every bucket group;
the step itself skips it where its update wrote the params). Grads are random with a global norm of ~0.3, under the clip threshold (1.0), so the update runs
the launch without `grad_scale` (the common steady state); weight decay 0.01 on matrices.

The floor of each row is the bytes it must move over the measured copy bandwidth (a large device-to-device
copy, bytes read + written). Per parameter: fused AdamW reads p, g, m, v and writes p, m, v: 28 B. moectl
adds the norm's read of g (4 B): 32 B for fp32 params, whose masters are the params; bf16 params add the
write-back of their separate masters, fp32 read + bf16 write (6 B): 38 B, or, where the update kernel writes
the bf16 params itself (CUDA), 2 B: 34 B. A step that clips divides the grads by `grad_scale` on the fly (torch's kernel, the
fallback, also stores them: +4 B, not in these rows).

A second table: the post-step quantize of low-precision param gather for one single grouped expert weight
`[E, out, in]` (default E=128, 1536 x 2048: an fc1 of Qwen3-30B-A3B's shape), bf16 in, rowwise and columnwise
copies out, as `recipe.quantize_weight` runs it after the optimizer step (mxfp8: after the gather, on every
rank; tensorwise: the same quantizer the stager runs on shards): ONE call over the whole grouped weight
against a per-expert loop of E calls over E separate `[out, in]` weights (Megatron's per-expert params).
Target: the single call >= 2x faster at E=128. Floor: bf16 read + two FP8 copies written = 4 B/param.

So moectl's fp32 floor is 32/28 = 1.14x fused AdamW's: the target (>= 0.8x its throughput) leaves room for
the norm and the few scalar kernels of the verdict, not for a write-back or a host sync between the norm
and the update.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from ckpt.staging import host_memory_available
from moectl.bench.optimizer_step_muon import build_muon, muon_rows, ns_flops_per_step
from moectl.bench.param_mix import MixShape, build_params, copy_bandwidth_gbps, device_meta
from moectl.bench.timing import interleaved_ms
from moectl.core.errors import UsageError

BYTES_PER_PARAM = {"torch_fused": 28, "moectl_fp32": 32, "moectl_bf16": 38}
#: the bf16 row where the update kernel writes the params itself (CUDA: `kernels/adamw_triton.py`)
BF16_PUBLISHED_BYTES_PER_PARAM = 34
#: the parts timed alone: norm (read g), update (fused AdamW), bf16 write-back (fp32 master read, bf16 write)
PART_BYTES_PER_PARAM = {"grad norm": 4, "update": 28, "write-back": 6}
PART_LABELS = {"grad norm": "fp32 step part: grad norm", "update": "fp32 step part: update",
               "write-back": "bf16 step part: write-back"}
QUANT_RECIPES = ("mxfp8", "tensorwise")
QUANT_BYTES_PER_PARAM = 4  # bf16 read, rowwise and columnwise FP8 bytes written (scales are < 4% more for mxfp8)
GRAD_SCALE = 1e-5  # randn * this: global norm ~ 1e-5 * sqrt(N) = 0.28 at 803.5M, under clip_grad = 1.0


@dataclass
class OptBenchConfig:
    """What to run; `quick()` is a CPU smoke configuration."""

    device: str = "cuda"
    shape: MixShape = field(default_factory=MixShape.default)
    warmup: int = 3
    rounds: int = 5
    per_round: int = 4
    copy_mib: int = 2048
    lr: float = 1e-4
    quant_shape: tuple[int, int, int] = (128, 1536, 2048)  # the grouped weight of the quantize rows [E, out, in]
    quant_recipes: tuple[str, ...] = QUANT_RECIPES
    fused: bool | None = None  # moectl's AdamW: None is its default (fused on CUDA); True runs the CUDA path on a CPU

    @staticmethod
    def quick(device: str | None = None) -> "OptBenchConfig":
        return OptBenchConfig(device=device or "cpu", shape=MixShape.quick(), warmup=1, rounds=2, per_round=2,
                              copy_mib=16, quant_shape=(128, 32, 64))


@dataclass
class OptBenchResult:
    meta: dict[str, Any]
    copy_gbps: float
    rows: list[dict[str, Any]]
    notes: list[str]
    quant_rows: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _fill_grads(grads: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator(device=grads[0].device).manual_seed(seed)
    for t in grads:
        t.copy_(torch.randn(t.shape, generator=g, device=t.device).mul_(GRAD_SCALE))


def _torch_fused(cfg: OptBenchConfig, device: torch.device) -> Callable[[], object]:
    from trainer.engine import param_groups

    model = build_params(cfg.shape, device, torch.float32, seed=1)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.empty_like(p)
    _fill_grads([p.grad for p in params], seed=2)  # type: ignore[misc]
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=True)
    return opt.step


def _moectl(cfg: OptBenchConfig, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, Callable[[], object]]:
    from moectl.core.config.schema import OptimizerConfig, ParallelConfig
    from trainer.distributed import DistributedModel
    from trainer.parallel import ParallelState
    from trainer.optim.distributed_optimizer import DistributedOptimizer

    model = build_params(cfg.shape, device, dtype, seed=1)
    dm = DistributedModel(model, ParallelConfig(), ParallelState.trivial(device))
    opt = DistributedOptimizer(dm, OptimizerConfig(lr=cfg.lr, weight_decay=0.01, clip_grad=1.0), fused=cfg.fused)
    _fill_grads([b.grad_data for b in dm.buffers], seed=2)

    def step() -> object:
        dm.finish_grad_sync()  # dp=1: no collective; moves the groups to `reduced` as the loop does
        return opt.step(cfg.lr)

    return dm, opt, step


def _parts(opt32: Any, opt16: Any, lr: float) -> dict[str, Callable[[], object]]:
    """The step's parts, each alone: the fp32 step's norm and update, the bf16 write-back as staging runs it.

    The fp32 step has no write-back (its masters are the params); the bf16 one's is timed as a staging pass
    (the step skips it where the update kernel wrote the params: the saving it reports).
    """
    from trainer.optim.grad_norm import global_grad_verdict

    def write_back() -> None:
        with torch.no_grad():
            for s in opt16.shards:  # what staging runs where the update did not write the params
                if not s.aliased:
                    s.stage()

    parts: dict[str, Callable[[], object]] = {
        "grad norm": lambda: global_grad_verdict(opt32.local_grad_sq(), opt32.dmodel.pstate.dp),
        "write-back": write_back,
    }
    if opt32.device_verdict:  # CUDA: the step's update is these gated kernel calls (the CPU step runs unfused)
        if opt32.step_count == 0:
            raise RuntimeError("time the update part after a step: the bias correction of step 0 divides by 0")
        verdict = opt32.grad_verdict()
        parts["update"] = lambda: opt32._update_on_device(lr, verdict)
    return parts


def _recipe(name: str) -> Any:
    from trainer.precision.recipes import MXFP8Recipe, TensorwiseRecipe

    return {"mxfp8": MXFP8Recipe, "tensorwise": TensorwiseRecipe}[name](fp8_format="e4m3")


def quantize_calls(cfg: OptBenchConfig, device: torch.device) -> dict[str, Callable[[], object]]:
    """Per recipe: one quantize call over the grouped weight, and the per-expert loop over separate weights."""
    E, out, inp = cfg.quant_shape
    g = torch.Generator(device=device).manual_seed(3)
    w = (torch.randn(E, out, inp, generator=g, device=device) * inp**-0.5).to(torch.bfloat16)
    per_expert = [w[e].clone() for e in range(E)]  # separate tensors, as per-expert params are
    fns: dict[str, Callable[[], object]] = {}
    for name in cfg.quant_recipes:
        recipe = _recipe(name)
        fns[f"{name}:grouped"] = lambda r=recipe: r.quantize_weight(w, rowwise=True, columnwise=True)
        fns[f"{name}:loop"] = lambda r=recipe: [r.quantize_weight(t, rowwise=True, columnwise=True) for t in per_expert]
    return fns


def check_quantize_equal(cfg: OptBenchConfig, device: torch.device) -> None:
    """The grouped call's bytes and scales equal the per-expert loop's, expert by expert (else the race is moot)."""
    E, out, inp = cfg.quant_shape
    g = torch.Generator(device=device).manual_seed(4)
    w = (torch.randn(min(E, 4), out, inp, generator=g, device=device) * inp**-0.5).to(torch.bfloat16)
    for name in cfg.quant_recipes:
        recipe = _recipe(name)
        whole = recipe.quantize_weight(w, rowwise=True, columnwise=True)
        for e in range(w.shape[0]):
            one = recipe.quantize_weight(w[e].clone(), rowwise=True, columnwise=True)
            mine = whole.expert(e)
            for which in ("rowwise", "columnwise"):
                a, b = getattr(mine, which), getattr(one, which)
                if not (torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
                        and torch.equal(a.scale.reshape(-1).float(), b.scale.reshape(-1).float())):
                    raise AssertionError(f"{name}: grouped quantize differs from expert {e}'s own ({which})")


def run_quantize(cfg: OptBenchConfig, device: torch.device, copy_gbps: float,
                 log: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[str]]:
    """The quantize table: grouped one call vs the per-expert loop, per recipe."""
    E, out, inp = cfg.quant_shape
    n = E * out * inp
    check_quantize_equal(cfg, device)
    log(f"post-step quantize of [{E}, {out}, {inp}] bf16: one call vs {E} per-expert calls ...")
    samples = interleaved_ms(quantize_calls(cfg, device), device, cfg.warmup, cfg.rounds, cfg.per_round)
    ms = {k: statistics.median(v) for k, v in samples.items()}
    rows, notes = [], []
    floor_ms = QUANT_BYTES_PER_PARAM * n / (copy_gbps * 1e9) * 1e3
    for name in cfg.quant_recipes:
        speedup = ms[f"{name}:loop"] / ms[f"{name}:grouped"]
        for how, label in (("grouped", "one call, grouped [E, out, in]"), ("loop", f"per-expert loop ({E} calls)")):
            t = ms[f"{name}:{how}"]
            rows.append({
                "recipe": name, "how": how, "name": f"{name}: {label}", "ms": t, "experts": E, "out": out, "in": inp,
                "gbps": QUANT_BYTES_PER_PARAM * n / (t * 1e-3) / 1e9, "floor_ms": floor_ms,
                "pct_floor": 100 * floor_ms / t, "grouped_speedup": speedup if how == "grouped" else None,
            })  # fmt: skip
        notes.append(f"quantize {name}: one grouped call runs at {speedup:.2f}x the per-expert loop's speed at E={E} "
                     f"(target >= 2x: {'met' if speedup >= 2 else 'MISSED'})")
    notes.append("grouped and per-expert quantization checked equal, bytes and scales, before timing")
    return rows, notes


#: host bytes per param with every optimizer of the table alive at once (torch's and moectl's fp32 AdamW at
#: 16 each, moectl's bf16 AdamW at 18, Muon at 14, grads included), an estimate for refusing a run up front
HOST_BYTES_PER_PARAM = 64


def check_fits(cfg: OptBenchConfig) -> None:
    """On a CPU, refuse a mix whose optimizers cannot all be held in memory: the kernel's out-of-memory killer
    ended such a run with exit code 137 and no word (803.5M params on a 23 GiB machine)."""
    if torch.device(cfg.device).type != "cpu":
        return
    need, have = cfg.shape.numel() * HOST_BYTES_PER_PARAM, host_memory_available()
    if have is not None and need > have:
        raise UsageError(
            f"bench optimizer-step: {cfg.shape.numel() / 1e6:.1f}M params need about {need / 2**30:.0f} GiB of host "
            f"memory for its optimizers, {have / 2**30:.0f} GiB are available",
            "pass --quick (a small mix), or run it on a GPU",
        )


def run(cfg: OptBenchConfig, log: Callable[[str], None] = lambda s: None) -> OptBenchResult:
    check_fits(cfg)
    device = torch.device(cfg.device)
    n = cfg.shape.numel()
    meta = {**device_meta(device), "shape": cfg.shape.to_json(), "warmup": cfg.warmup, "rounds": cfg.rounds,
            "per_round": cfg.per_round, "grad_scale": GRAD_SCALE}
    log(f"copy bandwidth ({cfg.copy_mib} MiB) ...")
    copy = copy_bandwidth_gbps(device, cfg.copy_mib << 20)
    log(f"{cfg.shape.describe()}: building torch AdamW(fused) and moectl's optimizers ...")
    fns = {"torch_fused": _torch_fused(cfg, device)}
    _, opt32, fns["moectl_fp32"] = _moectl(cfg, device, torch.float32)
    _, opt16, fns["moectl_bf16"] = _moectl(cfg, device, torch.bfloat16)
    if not all(s.aliased for s in opt32.shards):
        raise AssertionError("the fp32 params' masters are not the param buffer: the fp32 row would write back")
    fns["moectl_fp32"]()  # one step first: the update part runs at step count >= 1
    parts = _parts(opt32, opt16, cfg.lr)
    muon, muon_fns = build_muon(cfg.shape, device, cfg.lr, _fill_grads)
    log("timing (interleaved rounds) ...")
    samples = interleaved_ms({**fns, **parts, **muon_fns}, device, cfg.warmup, cfg.rounds, cfg.per_round)
    ms = {k: statistics.median(v) for k, v in samples.items()}
    t_torch = ms["torch_fused"]
    rows = []
    labels = {
        "torch_fused": "torch AdamW(fused=True), fp32 params",
        "moectl_fp32": "moectl DistributedOptimizer, fp32 params",
        "moectl_bf16": "moectl DistributedOptimizer, bf16 params",
    }
    per_param = dict(BYTES_PER_PARAM)
    if getattr(opt16, "triton", False):  # the update wrote the bf16 params: no separate write-back
        per_param["moectl_bf16"] = BF16_PUBLISHED_BYTES_PER_PARAM
    for key, label in labels.items():
        nbytes = per_param[key] * n
        floor_ms = nbytes / (copy * 1e9) * 1e3
        rows.append({
            "name": label, "key": key, "ms": ms[key], "bytes_per_param": per_param[key],
            "gbytes": nbytes / 1e9, "gbps": nbytes / (ms[key] * 1e-3) / 1e9, "floor_ms": floor_ms,
            "pct_floor": 100 * floor_ms / ms[key], "throughput_vs_torch": t_torch / ms[key],
        })  # fmt: skip
    for key, b in PART_BYTES_PER_PARAM.items():
        if key not in ms:
            continue
        nbytes = b * n
        floor_ms = nbytes / (copy * 1e9) * 1e3
        rows.append({
            "name": f"  {PART_LABELS[key]}", "key": key, "ms": ms[key], "bytes_per_param": b,
            "gbytes": nbytes / 1e9, "gbps": nbytes / (ms[key] * 1e-3) / 1e9, "floor_ms": floor_ms,
            "pct_floor": 100 * floor_ms / ms[key], "throughput_vs_torch": None,
        })  # fmt: skip
    notes = [
        f"{n / 1e6:.1f}M params; copy bandwidth {copy:.0f} GB/s (read + write); "
        "floor = bytes per param x params / copy bandwidth",
        f"target: moectl fp32 >= 0.8x torch fused throughput; measured {t_torch / ms['moectl_fp32']:.2f}x",
    ]
    notes.append("fp32 params: the masters are the param buffer (no write-back); the norm and found-inf stay on "
                 "the device until the update is queued")
    if "update" in ms:
        lean = ms["grad norm"] + ms["update"]
        notes.append(f"norm + update alone (the fp32 step's kernels): {lean:.3f} ms, {t_torch / lean:.2f}x torch "
                     f"fused; the rest of the step ({ms['moectl_fp32'] - lean:.3f} ms) is the verdict's scalar kernels, "
                     "its host read and the launch overhead")
    else:
        notes.append("the update part is timed for the fused step only (the CPU default runs the unfused AdamW)")
    mrows, mnotes = muon_rows(ms, t_torch, ns_flops_per_step(muon))
    rows += mrows
    notes += mnotes
    result = OptBenchResult(meta, copy, rows, notes)
    if cfg.quant_recipes:
        del fns, parts, opt32, muon, muon_fns
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result.quant_rows, qnotes = run_quantize(cfg, device, copy, log)
        result.notes.extend(qnotes)
        meta["quant_shape"] = list(cfg.quant_shape)
    return result
