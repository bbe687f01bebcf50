"""`moectl bench optimizer-step`: moectl's DistributedOptimizer step (dp=1) against `torch.optim.AdamW(fused=True)`.

Both step the same parameter set (`param_mix.MixShape`, 803.5M parameters by default) with fp32 grads:

    torch fused     `torch.optim.AdamW(fused=True)` over fp32 params with `.grad` set (decay / no-decay groups)
    moectl fp32     `DistributedModel` + `DistributedOptimizer` over fp32 params: the step the loop runs
                    (global grad norm with its found-inf check, clip factor, fused AdamW on the fp32 masters,
                    write-back of the masters into the param buffer, the param sync's post-processing)
    moectl bf16     the same with bf16 params (mixed precision: fp32 grads and masters, bf16 write-back)

plus the fp32 step's parts timed alone: the grad norm (`local_grad_sq` + the all-reduce and host read of
the global norm), the update (the same `torch._fused_adamw_` calls on the same shard lists), and the
write-back (staging every bucket group). Grads are random with a global norm of ~0.3, under the clip
threshold (1.0), so no clip multiply runs (the common steady state); weight decay 0.01 on matrices.

The floor of each row is the bytes it must move over the measured copy bandwidth (a large device-to-device
copy, bytes read + written). Per parameter: fused AdamW reads p, g, m, v and writes p, m, v: 28 B. moectl
adds the norm's read of g (4 B) and the write-back: fp32 read + fp32 write (8 B), or fp32 read + bf16
write (6 B): 40 B and 38 B. So moectl's floor is 1.43x fused AdamW's on fp32 params, by design of keeping
fp32 masters apart from the params: the 0.8x throughput target needs the masters of fp32 params to be
the param buffer itself (Megatron does this), see docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from moectl.bench.param_mix import MixShape, build_params, copy_bandwidth_gbps, device_meta
from moectl.bench.timing import interleaved_ms

BYTES_PER_PARAM = {"torch_fused": 28, "moectl_fp32": 40, "moectl_bf16": 38}
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

    @staticmethod
    def quick(device: str | None = None) -> "OptBenchConfig":
        return OptBenchConfig(device=device or "cpu", shape=MixShape.quick(), warmup=1, rounds=2, per_round=2,
                              copy_mib=16)


@dataclass
class OptBenchResult:
    meta: dict[str, Any]
    copy_gbps: float
    rows: list[dict[str, Any]]
    notes: list[str]

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
    from moectl.config.schema import OptimizerConfig, ParallelConfig
    from trainer.distributed import DistributedModel, ParallelState
    from trainer.optim.distributed_optimizer import DistributedOptimizer

    model = build_params(cfg.shape, device, dtype, seed=1)
    dm = DistributedModel(model, ParallelConfig(), ParallelState.trivial(device))
    opt = DistributedOptimizer(dm, OptimizerConfig(lr=cfg.lr, weight_decay=0.01, clip_grad=1.0))
    _fill_grads([b.grad_data for b in dm.buffers], seed=2)

    def step() -> object:
        dm.finish_grad_sync()  # dp=1: no collective; moves the groups to `reduced` as the loop does
        return opt.step(cfg.lr)

    return dm, opt, step


def _parts(opt: Any, lr: float) -> dict[str, Callable[[], object]]:
    """The fp32 step's parts, each alone: norm, update (same kernel, same lists), write-back."""
    from trainer.optim.adamw import fused_adamw_update_
    from trainer.optim.grad_norm import global_norm_and_found_inf

    lists: dict[bool, list[list[torch.Tensor]]] = {True: [[], [], [], []], False: [[], [], [], []]}
    for s in opt.shards:
        for a, b, decay in s.runs:
            for lst, t in zip(lists[decay], (s.master, s.grad(), s.exp_avg, s.exp_avg_sq)):
                lst.append(t[a:b])
    step = torch.ones((), dtype=torch.float32, device=opt.device)
    hp = dict(lr=lr, beta1=0.9, beta2=0.95, eps=1e-8)

    def update() -> None:
        fused_adamw_update_(*lists[True], step=step, weight_decay=0.01, **hp)
        fused_adamw_update_(*lists[False], step=step, weight_decay=0.0, **hp)

    def write_back() -> None:
        with torch.no_grad():
            for g in opt.groups:
                opt._stage_group(g)  # what g.stage() runs, without the state machine

    parts: dict[str, Callable[[], object]] = {
        "grad norm": lambda: global_norm_and_found_inf(opt.local_grad_sq(), opt.dmodel.pstate.dp),
        "write-back": write_back,
    }
    if opt.fused:  # CUDA: the step's update is these two kernel calls (on CPU the step runs the unfused path)
        parts["update"] = update
    return parts


def run(cfg: OptBenchConfig, log: Callable[[str], None] = lambda s: None) -> OptBenchResult:
    device = torch.device(cfg.device)
    n = cfg.shape.numel()
    meta = {**device_meta(device), "shape": cfg.shape.to_json(), "warmup": cfg.warmup, "rounds": cfg.rounds,
            "per_round": cfg.per_round, "grad_scale": GRAD_SCALE}
    log(f"copy bandwidth ({cfg.copy_mib} MiB) ...")
    copy = copy_bandwidth_gbps(device, cfg.copy_mib << 20)
    log(f"{cfg.shape.describe()}: building torch AdamW(fused) and moectl's optimizers ...")
    fns = {"torch_fused": _torch_fused(cfg, device)}
    _, opt32, fns["moectl_fp32"] = _moectl(cfg, device, torch.float32)
    _, _, fns["moectl_bf16"] = _moectl(cfg, device, torch.bfloat16)
    parts = _parts(opt32, cfg.lr)
    log("timing (interleaved rounds) ...")
    samples = interleaved_ms({**fns, **parts}, device, cfg.warmup, cfg.rounds, cfg.per_round)
    ms = {k: statistics.median(v) for k, v in samples.items()}
    t_torch = ms["torch_fused"]
    rows = []
    labels = {
        "torch_fused": "torch AdamW(fused=True), fp32 params",
        "moectl_fp32": "moectl DistributedOptimizer, fp32 params",
        "moectl_bf16": "moectl DistributedOptimizer, bf16 params",
    }
    for key, label in labels.items():
        nbytes = BYTES_PER_PARAM[key] * n
        floor_ms = nbytes / (copy * 1e9) * 1e3
        rows.append({
            "name": label, "key": key, "ms": ms[key], "bytes_per_param": BYTES_PER_PARAM[key],
            "gbytes": nbytes / 1e9, "gbps": nbytes / (ms[key] * 1e-3) / 1e9, "floor_ms": floor_ms,
            "pct_floor": 100 * floor_ms / ms[key], "throughput_vs_torch": t_torch / ms[key],
        })  # fmt: skip
    part_bytes = {"grad norm": 4, "update": 28, "write-back": 8}
    for key, b in part_bytes.items():
        if key not in ms:
            continue
        nbytes = b * n
        floor_ms = nbytes / (copy * 1e9) * 1e3
        rows.append({
            "name": f"  fp32 step part: {key}", "key": key, "ms": ms[key], "bytes_per_param": b,
            "gbytes": nbytes / 1e9, "gbps": nbytes / (ms[key] * 1e-3) / 1e9, "floor_ms": floor_ms,
            "pct_floor": 100 * floor_ms / ms[key], "throughput_vs_torch": None,
        })  # fmt: skip
    notes = [
        f"{n / 1e6:.1f}M params; copy bandwidth {copy:.0f} GB/s (read + write); "
        "floor = bytes per param x params / copy bandwidth",
        f"target: moectl fp32 >= 0.8x torch fused throughput; measured {t_torch / ms['moectl_fp32']:.2f}x",
    ]
    if "update" in ms:
        lean = ms["grad norm"] + ms["update"]
        notes.append(f"norm + update alone (no write-back, i.e. masters aliased on fp32 params): {lean:.3f} ms, "
                     f"{t_torch / lean:.2f}x torch fused")
    else:
        notes.append("the update part is timed on CUDA only (the CPU step runs the unfused AdamW)")
    return OptBenchResult(meta, copy, rows, notes)
