"""`moectl bench grouped-mlp`: the routed-expert MLP, forward and forward+backward, path by path.

Legend: E experts, D hidden (h), F expert ffn (f), m rows per expert, T = E*m routed rows, N = T/k tokens.

Paths (all compute the same function, y = probs * fc2(swiglu(fc1(x))), bf16 on CUDA):
    loop     a per-expert Python loop of matmuls over per-expert weights (Megatron's SequentialMLP way)
    eager    torch._grouped_mm for fc1 (gate and up in one GEMM) and fc2, eager silu*mul between,
             probs applied to the output in fp32 (torchtitan's GroupedExperts way, with w1/w3 merged)
    compile  the same function under torch.compile (default mode)
    grouped  moectl's `grouped` backend (trainer/moe/backends/grouped.py)
    fused    moectl's `fused` backend (trainer/moe/backends/fused.py: Triton activation with probs)
    te       moectl's `te` backend (trainer/moe/backends/te.py: Transformer Engine's grouped GEMMs and
             row-scaled SwiGLU); only on CUDA with TE installed, else a note says why (moectl/bench/te_paths.py)
plus the fp8 columns of `grouped_mlp_fp8` (FP8_PATHS: moectl's fused backend under the fp8 tensorwise and
rowwise recipes, `torch._scaled_grouped_mm` unfused, torchao's MoE fp8 path, and the `te` backend under the
fp8 tensorwise recipe; compared with `fused`, bf16). `fused_vs_te` and `fp8_tensorwise_vs_te` are TE's time
over ours (> 1: ours faster),
and the ceiling: a dense size^3 bf16 matmul measured at the start of the run, against which every number
is also given as a percentage; the same matmul is timed again inside every row's interleaved rounds
(`dense_row_tflops`), which shows how much the device itself slowed down while the row was measured.

TFLOP/s count only the GEMMs, 2*M*N*K each: forward = fc1 + fc2 = 2*T*D*(H + F); forward+backward = 3x
that (dgrad and wgrad of both). Two sets of rows: the expert MLP alone, and with the permute/unpermute of
`trainer.moe.dispatch.LocalDispatcher` around it (sort by expert, gather, and the combine back to tokens;
each token routed to k experts). Routing is balanced, m rows per expert, so the shapes are the ones named.
Every timed call uses a real upstream grad (`randn_like(y)`), never an expanded one.

Three timings per path (moectl/bench/timing.py): per call from an idle queue (the headline column), with the
host queued ahead after a rest (`_queued_ms`), and in steady state under continuous load (`_sustained_ms`,
with the SM clock, board power and allocator retries meanwhile). The first two start from a rested device,
which boosts; a 700 W Hopper board in training runs at the clock of the third. The weights of every
default shape are hundreds of MB, far over the L2 (50-60 MB), so repeated calls do not run from cache.

Out of memory is a result, not a crash (moectl/bench/oom.py): a shape whose inputs do not fit gives error
rows, a path that does not fit (each path runs once before the timing) an `OOM` cell and `<path>_error`, a
row whose timing runs out an error row; the run goes on. The fp8 paths' error check runs at a slice of the
shape (`error_check_shape`: at most half, at most 8 of its experts), with outputs kept in the bench dtype
and compared slab by slab, so it needs less memory than the path it checks.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from moectl.bench import grouped_mlp_fp8 as fp8
from moectl.bench.backend_function import BackendFunction
from moectl.bench import te_paths
from moectl.bench.oom import as_oom, free
from moectl.bench.timing import SUSTAINED_SECONDS, dense_ceiling_tflops, dense_matmul, interleaved_ms, queued_ms, sustained_ms
from moectl.core.arith import ceil_div
from moectl.core.rules import INT64_MAX

#: the widest element a path's tensors hold (the routing's int64 indices; the activations are at most fp32)
_MAX_ELEMENT_BYTES = 8

PATHS = ("loop", "eager", "compile", "grouped", "fused", "te")  # bf16 (fp32 in --quick on CPU)
FP8_PATHS = fp8.FP8_PATHS
ALL_PATHS = PATHS + FP8_PATHS
# What a default run times: ours, the peers (compile, torchtitan's grouped, TE, torchao) and the fp8 paths the
# targets are about. The rest are diagnostics, by `--path`: the per-expert loop, the intermediate fp8 steps,
# and the rowwise columns (emulated or unfused on Hopper, 10x slower per call). Every column of a default run
# made it outlast one 10-minute device call (tenth session: 1.7 of 4 shapes in 320 s).
DEFAULT_PATHS = ("eager", "compile", "grouped", "fused", "te", "fp8_tensorwise", "fp8_tensorwise_pq_fa",
                 "torchao_rowwise", "te_fp8_tensorwise")  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """One benchmark shape: experts, hidden, expert ffn, rows per expert."""

    experts: int
    hidden: int
    ffn: int
    tokens_per_expert: int

    @property
    def rows(self) -> int:
        return self.experts * self.tokens_per_expert

    def label(self) -> str:
        return f"E={self.experts} h={self.hidden} f={self.ffn} m={self.tokens_per_expert}"

    def gemm_flops(self, backward: bool) -> float:
        """2*M*N*K per GEMM; fc1 has N = 2f (gate and up), fc2 K = f. Backward doubles it (dgrad + wgrad)."""
        fwd = 2.0 * self.rows * self.hidden * (2 * self.ffn + self.ffn)
        return 3.0 * fwd if backward else fwd

    @staticmethod
    def parse(text: str) -> "Shape":
        """'E,h,f,m' -> Shape; refuses what no path could run: non-integers, h or f not a multiple of 8
        (the grouped GEMMs need 16-byte row strides in bf16), and a shape whose tensors no int64 size holds
        (`--shape 4,8,8,99999999999999999999`'s inputs ended the bench in a traceback from `torch.randperm`, "Overflow when
        unpacking long long"; one merely too big for memory is an `OOM` row instead)."""
        try:
            parts = [int(p) for p in text.replace("x", ",").split(",")]
        except ValueError:
            parts = []
        if len(parts) != 4 or min(parts) <= 0:
            raise ValueError(f"shape {text!r}: expected four positive integers E,h,f,m")
        if parts[1] % 8 or parts[2] % 8:
            raise ValueError(f"shape {text!r}: h and f must be multiples of 8 (16-byte rows for the grouped GEMMs)")
        shape = Shape(*parts)
        if shape.largest_tensor() * _MAX_ELEMENT_BYTES > INT64_MAX:
            raise ValueError(f"shape {text!r}: its largest tensor would hold {shape.largest_tensor():,} elements, more "
                             "than torch can address (its sizes are int64); give smaller numbers")
        return shape

    def largest_tensor(self) -> int:
        """Elements of the largest tensor a path builds: fc1's weight [E, 2f, h], or the rows' activations
        [E*m, max(h, 2f)]."""
        return max(self.experts * 2 * self.ffn * self.hidden, self.rows * max(self.hidden, 2 * self.ffn))


DEFAULT_SHAPES = (
    Shape(8, 4096, 14336, 2048),
    Shape(32, 4096, 1536, 1024),
    Shape(64, 2048, 1408, 512),
    Shape(128, 7168, 2048, 256),
)
QUICK_SHAPES = (Shape(4, 64, 96, 32), Shape(8, 32, 64, 16))


@dataclass
class BenchConfig:
    """What to run. `quick`: tiny shapes, few iterations (CI smoke); fp32 on CPU."""

    shapes: tuple[Shape, ...] = DEFAULT_SHAPES
    paths: tuple[str, ...] = DEFAULT_PATHS
    permute: bool = True
    profile: tuple[str, ...] = ()  # paths whose fwd+bwd kernels are profiled at the first shape (GEMM vs rest)
    warmup: int = 5
    iters: int = 30  # timed calls per path and row, spread over `rounds` interleaved rounds
    rounds: int = 5
    sustained_seconds: float = SUSTAINED_SECONDS  # per path and round of the steady-state column (0: none)
    sustained_rounds: int = 3
    # The steady-state regime (6 s per path by default) was 85% of a default run, which then outlasted a
    # 10-minute device call (ninth session): by default it runs on the rows training runs, fwd+bwd without the
    # bench's own permute; `sustained_every_row` restores it everywhere.
    sustained_every_row: bool = False
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: torch.dtype = torch.bfloat16
    ceiling_size: int = 8192
    topk: Optional[int] = None  # None: 2 for E <= 8, else 8 (Mixtral-like vs DeepSeek/Qwen-like)
    compile_on_cpu: bool = False
    seed: int = 0

    @staticmethod
    def quick_config(device: Optional[str] = None) -> "BenchConfig":
        dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return BenchConfig(
            shapes=QUICK_SHAPES, paths=ALL_PATHS,  # the smoke test runs every column
            warmup=1, iters=3, rounds=1, device=dev, sustained_seconds=0.2, sustained_rounds=1,
            dtype=torch.bfloat16 if dev == "cuda" else torch.float32, ceiling_size=256 if dev == "cpu" else 2048,
        )  # fmt: skip


@dataclass
class BenchResult:
    """Rows (one per shape x pass x permute) and what the run measured them against."""

    meta: dict[str, Any]
    ceiling_tflops: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    profiles: dict[str, Any] = field(default_factory=dict)  # path -> kernel-time split (GEMM vs the rest)

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "ceiling_tflops": self.ceiling_tflops, "rows": self.rows, "notes": self.notes,
                "profiles": self.profiles}


# ----------------------------------------------------------------------------------------------------------
# the baselines, written the way a user would


def eager_expert_mlp(
    x_TD: torch.Tensor, w1_EHD: torch.Tensor, w2_EDF: torch.Tensor, offs_E: torch.Tensor, probs_T: torch.Tensor
) -> torch.Tensor:
    """torchtitan's GroupedExperts (w1/w3 as one [gate; up] GEMM): grouped GEMMs + eager silu*mul + probs."""
    h_TH = torch._grouped_mm(x_TD, w1_EHD.transpose(-2, -1), offs=offs_E)
    g_TF, u_TF = h_TH.chunk(2, dim=-1)
    y_TD = torch._grouped_mm(F.silu(g_TF) * u_TF, w2_EDF.transpose(-2, -1), offs=offs_E)
    return (y_TD.float() * probs_T[:, None]).to(y_TD.dtype)


def loop_expert_mlp(
    x_TD: torch.Tensor, w1s: list[torch.Tensor], w2s: list[torch.Tensor], splits: list[int], probs_T: torch.Tensor
) -> torch.Tensor:
    """Per-expert matmuls over per-expert weights (a loop over experts, splits known on the host)."""
    outs = []
    for x_e, w1, w2 in zip(torch.split(x_TD, splits), w1s, w2s):
        g, u = (x_e @ w1.t()).chunk(2, dim=-1)
        outs.append((F.silu(g) * u) @ w2.t())
    y_TD = torch.cat(outs)
    return (y_TD.float() * probs_T[:, None]).to(y_TD.dtype)


# ----------------------------------------------------------------------------------------------------------
# one shape


@dataclass
class _Inputs:
    """Everything every path reads, drawn once per shape from one seed (random data: zeros run faster)."""

    x_TD: torch.Tensor  # the expert input (already permuted)
    x_ND: torch.Tensor  # the tokens, for the permute rows
    w1_EHD: torch.Tensor
    w2_EDF: torch.Tensor
    w1s: list[torch.Tensor]
    w2s: list[torch.Tensor]
    probs_T: torch.Tensor
    probs_NK: torch.Tensor
    indices_NK: torch.Tensor
    counts_E: torch.Tensor
    offs_E: torch.Tensor
    splits: list[int]


def _inputs(shape: Shape, topk: int, device: torch.device, dtype: torch.dtype, seed: int) -> _Inputs:
    g = torch.Generator(device=device).manual_seed(seed)
    E, D, Fd, m, T = shape.experts, shape.hidden, shape.ffn, shape.tokens_per_expert, shape.rows

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, device=device, generator=g) * scale).to(dtype).requires_grad_()

    w1 = randn(E, 2 * Fd, D, scale=D**-0.5)
    w2 = randn(E, D, Fd, scale=Fd**-0.5)
    # Balanced routing: every expert gets exactly m of the T = N*k routings (a token may pick one twice).
    slot_T = torch.randperm(T, device=device, generator=g)
    counts = torch.full((E,), m, dtype=torch.int64, device=device)
    return _Inputs(
        x_TD=randn(T, D),
        x_ND=randn(T // topk, D),
        w1_EHD=w1,
        w2_EDF=w2,
        w1s=[w.detach().clone().requires_grad_() for w in w1.unbind(0)],
        w2s=[w.detach().clone().requires_grad_() for w in w2.unbind(0)],
        probs_T=torch.rand(T, device=device, generator=g).requires_grad_(),
        probs_NK=torch.rand(T // topk, topk, device=device, generator=g).requires_grad_(),
        indices_NK=(slot_T // m).view(T // topk, topk),
        counts_E=counts,
        offs_E=torch.cumsum(counts, 0).to(torch.int32),
        splits=[m] * E,
    )


def _expert_fn(path: str, inp: _Inputs, spec: Any, compiled: Optional[Callable[..., torch.Tensor]]):
    """(fn(x, probs) -> y, the weight leaves to differentiate) for one path."""
    if path in FP8_PATHS:
        return fp8.expert_fn(path, inp, spec)
    if path == "loop":
        return (lambda x, p: loop_expert_mlp(x, inp.w1s, inp.w2s, inp.splits, p)), [*inp.w1s, *inp.w2s]
    if path in ("eager", "compile"):
        f = compiled if path == "compile" else eager_expert_mlp
        assert f is not None
        return (lambda x, p: f(x, inp.w1_EHD, inp.w2_EDF, inp.offs_E, p)), [inp.w1_EHD, inp.w2_EDF]
    from trainer.moe.backends import get_backend

    backend = get_backend(path, inp.x_TD.device)
    return (
        lambda x, p: BackendFunction.apply(x, inp.w1_EHD, inp.w2_EDF, p, inp.counts_E, backend, spec, None)
    ), [inp.w1_EHD, inp.w2_EDF]


def _step(fn, inp: _Inputs, weights: list[torch.Tensor], permute: bool, backward: bool, dy: torch.Tensor):  # type: ignore[no-untyped-def]
    """One timed call: forward (training mode: autograd records), then optionally a backward."""
    if permute:
        from trainer.moe.dispatch import LocalDispatcher
        from trainer.moe.router import RouterOutput

        E = inp.counts_E.numel()
        zero = inp.probs_NK.new_zeros(())
        route = RouterOutput(inp.probs_NK, inp.indices_NK, inp.counts_E, zero, zero)
        dispatcher = LocalDispatcher(E)

        def call() -> None:
            x_PD, _, probs_P, plan = dispatcher.dispatch(inp.x_ND, route)
            y = dispatcher.combine(fn(x_PD, probs_P), plan)
            if backward:
                torch.autograd.grad(y, [inp.x_ND, inp.probs_NK, *weights], dy)

    else:

        def call() -> None:
            y = fn(inp.x_TD, inp.probs_T)
            if backward:
                torch.autograd.grad(y, [inp.x_TD, inp.probs_T, *weights], dy)

    return call


def bench_shape(
    shape: Shape,
    cfg: BenchConfig,
    ceiling: float,
    dense: Callable[[], object],
    notes: list[str],
    log: Callable[[str], None],
    profiles: Optional[dict[str, Any]] = None,
) -> list[dict[str, Any]]:
    """The rows of one shape: (fwd, fwd+bwd) x (experts only, with permute). A shape, a path or a row that
    does not fit in memory is reported as such (`error`, `<path>_error`, and a note), never raised."""
    device = torch.device(cfg.device)
    topk = cfg.topk or (2 if shape.experts <= 8 else 8)
    try:
        inp = _inputs(shape, topk, device, cfg.dtype, cfg.seed)
    except RuntimeError as e:
        error = as_oom(e)
    else:
        return _bench_inputs(shape, cfg, inp, topk, ceiling, dense, notes, log, profiles)
    free(device)  # outside the except block: its traceback no longer holds the half-built inputs
    log(f"{shape.label()}: inputs do not fit ({error})")
    notes.append(f"{shape.label()}: {error}")
    return [_error_row(shape, topk, permute, backward, error)
            for permute in ((False, True) if cfg.permute else (False,)) for backward in (False, True)]


def _base_row(shape: Shape, topk: int, permute: bool, backward: bool) -> dict[str, Any]:
    return {"shape": shape.label(), **asdict(shape), "pass": "fwd+bwd" if backward else "fwd", "permute": permute,
            "topk": topk, "gemm_tflop": shape.gemm_flops(backward) / 1e12, "error": None}  # fmt: skip


def _error_row(shape: Shape, topk: int, permute: bool, backward: bool, error: str) -> dict[str, Any]:
    """A row whose shape could not be measured: every number None, the reason in `error`."""
    row = _base_row(shape, topk, permute, backward)
    row.update(error=error, queued_host_behind=[], dense_row_tflops=None, fused_vs_eager=None, fused_vs_compile=None,
               fused_vs_te=None, fp8_tensorwise_vs_te=None)  # fmt: skip
    for path in ALL_PATHS:
        for suffix in ("ms", "queued_ms", "sustained_ms", "sustained_mhz", "sustained_watts", "ms_min", "ms_max",
                       "tflops", "pct_ceiling", "error", "rel_err", "mode", "vs_fused", "queued_vs_fused",
                       "sustained_vs_fused"):  # fmt: skip
            row[f"{path}_{suffix}"] = None
        row[f"{path}_sustained_alloc_retries"] = 0
    for base in ("sgmm_rowwise", "torchao_rowwise"):
        row[f"fp8_rowwise_vs_{base}"] = None
    return row


def _probe(calls: dict[str, Callable[[], object]], device: torch.device) -> dict[str, str]:
    """Run each path once; {path: out-of-memory message} for those that do not fit (dropped from the row)."""
    failed: dict[str, str] = {}
    for path, call in list(calls.items()):
        try:
            call()
        except RuntimeError as e:
            failed[path] = as_oom(e)
        if path in failed:
            del calls[path]
            free(device)
    return failed


def _bench_inputs(
    shape: Shape,
    cfg: BenchConfig,
    inp: "_Inputs",
    topk: int,
    ceiling: float,
    dense: Callable[[], object],
    notes: list[str],
    log: Callable[[str], None],
    profiles: Optional[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The rows of one shape whose inputs fit; a path (or the whole row) that runs out of memory says so."""
    from trainer.moe.expert_math import ExpertSpec

    device = torch.device(cfg.device)
    spec = ExpertSpec("swiglu", shape.ffn, None)
    compiled = None
    if "compile" in cfg.paths and (device.type == "cuda" or cfg.compile_on_cpu):
        compiled = torch.compile(eager_expert_mlp, dynamic=False)
    paths = []
    for path in cfg.paths:
        if path in te_paths.TE_PATHS:
            ok, why = te_paths.available(path, device)
        else:
            ok, why = fp8.available(path, device) if path in FP8_PATHS else (True, "")
        if ok:
            paths.append(path)
        else:
            notes.append(why)
    fp8_paths = [p for p in paths if p in FP8_PATHS]
    errors = _fp8_errors(shape, cfg, spec, fp8_paths, log)
    rows: list[dict[str, Any]] = []
    for permute in (False, True) if cfg.permute else (False,):
        n_out = inp.x_ND.shape[0] if permute else shape.rows
        try:
            dy = torch.randn(n_out, shape.hidden, device=device, dtype=cfg.dtype)
        except RuntimeError as e:
            error = as_oom(e)
            rows += [_error_row(shape, topk, permute, backward, error) for backward in (False, True)]
            continue
        for backward in (False, True):
            flops = shape.gemm_flops(backward)
            calls: dict[str, Callable[[], object]] = {}
            path_errors: dict[str, str] = {}
            for path in paths:
                if path == "compile" and compiled is None:
                    continue
                try:
                    fn, weights = _expert_fn(path, inp, spec, compiled)
                except RuntimeError as e:  # e.g. the loop path's per-expert weight copies
                    path_errors[path] = as_oom(e)
                    continue
                calls[path] = _step(fn, inp, weights, permute, backward, dy)
            path_errors.update(_probe(calls, device))
            steady = cfg.sustained_every_row or (backward and not permute)
            timed = _time_row(calls, dense, cfg, device, steady)
            if isinstance(timed, str):  # the row's timing itself ran out of memory
                free(device)
                rows.append(_error_row(shape, topk, permute, backward, timed))
                log(f"{shape.label()} {rows[-1]['pass']}: {timed}")
                continue
            samples, queued, behind, sustained, states = timed
            row = _base_row(shape, topk, permute, backward)
            row["queued_host_behind"] = sorted(behind)
            row["fp8_error_check_shape"] = error_check_shape(shape).label() if fp8_paths else None
            dense_ms = statistics.median(samples["dense"])
            row["dense_row_tflops"] = 2 * cfg.ceiling_size**3 / (dense_ms * 1e-3) / 1e12
            for path in ALL_PATHS:
                times = samples.get(path)
                ms = statistics.median(times) if times else None
                tflops = None if ms is None else flops / (ms * 1e-3) / 1e12
                row[f"{path}_ms"] = ms
                row[f"{path}_queued_ms"] = statistics.median(queued[path]) if queued.get(path) else None
                row[f"{path}_sustained_ms"] = statistics.median(sustained[path]) if sustained.get(path) else None
                for unit in ("mhz", "watts"):  # what the power limit did meanwhile
                    got = [getattr(st, unit) for st in states.get(path, []) if getattr(st, unit) is not None]
                    row[f"{path}_sustained_{unit}"] = statistics.median(got) if got else None
                row[f"{path}_sustained_alloc_retries"] = sum(st.alloc_retries for st in states.get(path, []))
                row[f"{path}_ms_min"] = min(times) if times else None
                row[f"{path}_ms_max"] = max(times) if times else None
                row[f"{path}_tflops"] = tflops
                row[f"{path}_pct_ceiling"] = None if tflops is None else 100.0 * tflops / ceiling
                row[f"{path}_error"] = path_errors.get(path)
            for base in ("eager", "compile", "te"):
                ok = row["fused_ms"] is not None and row[f"{base}_ms"] is not None
                row[f"fused_vs_{base}"] = row[f"{base}_ms"] / row["fused_ms"] if ok else None
            ok = row["fp8_tensorwise_ms"] is not None and row["te_fp8_tensorwise_ms"] is not None
            row["fp8_tensorwise_vs_te"] = row["te_fp8_tensorwise_ms"] / row["fp8_tensorwise_ms"] if ok else None
            for path in FP8_PATHS:  # speed-up over our bf16 fused path (> 1: the fp8 path is faster)
                for regime in ("", "_queued", "_sustained"):  # per call, host ahead after a rest, steady state
                    base, this = row[f"fused{regime}_ms"], row[f"{path}{regime}_ms"]
                    row[f"{path}{regime}_vs_fused"] = base / this if base is not None and this is not None else None
                row[f"{path}_mode"] = fp8.recipe_mode(path, device) if row[f"{path}_ms"] is not None else None
                row[f"{path}_rel_err"] = errors.get(path)
            for base in ("sgmm_rowwise", "torchao_rowwise"):
                ok = row["fp8_rowwise_ms"] is not None and row[f"{base}_ms"] is not None
                row[f"fp8_rowwise_vs_{base}"] = row[f"{base}_ms"] / row["fp8_rowwise_ms"] if ok else None
            rows.append(row)
            log(_row_line(row))
            if profiles is not None and backward and not permute:
                for path in cfg.profile:
                    if path in calls and path not in profiles:
                        log(f"profiling {path} fwd+bwd at {shape.label()} ...")
                        try:
                            profiles[path] = {"shape": shape.label(), **fp8.kernel_profile(calls[path], device)}
                        except RuntimeError as e:
                            notes.append(f"profile of {path} at {shape.label()}: {as_oom(e)}")
    for row in rows:
        if row.get("error"):
            notes.append(f"{row['shape']} {row['pass']}{' +permute' if row['permute'] else ''}: {row['error']}")
        for path in ALL_PATHS:
            if row.get(f"{path}_error"):
                notes.append(f"{row['shape']} {path}: {row[f'{path}_error']}")
    if "compile" in cfg.paths and compiled is None:
        notes.append("compile skipped on CPU (slow to build; a CUDA run measures it)")
    for path in paths:
        if path in FP8_PATHS and fp8.recipe_mode(path, device) == "emulated":
            notes.append(
                f"fp8 columns EMULATED on {device.type} (no native torch._scaled_grouped_mm here): real fp8 values "
                "and scales, dequantized and multiplied in high precision; their times say nothing about fp8 speed"
            )
            break
    del inp
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _time_row(
    calls: dict[str, Callable[[], object]], dense: Callable[[], object], cfg: BenchConfig, device: torch.device,
    steady: bool = True,
) -> Any:
    """The three timing regimes of one row's paths (the steady state only where `steady`), or the
    out-of-memory message if they ran out."""
    calls = {**calls, "dense": dense}  # the ceiling again, in the same rounds: what the device gives right now
    rounds = max(1, min(cfg.rounds, cfg.iters))
    try:
        samples = interleaved_ms(calls, device, cfg.warmup, rounds, ceil_div(cfg.iters, rounds))
        paths_only = {k: v for k, v in calls.items() if k != "dense"}
        queued, behind = queued_ms(paths_only, device, rounds, ceil_div(cfg.iters, rounds))
        seconds = cfg.sustained_seconds if steady else 0.0
        sustained, states = sustained_ms(paths_only, device, cfg.sustained_rounds, seconds)
    except RuntimeError as e:
        return as_oom(e)
    return samples, queued, behind, sustained, states


ERROR_CHECK_EXPERTS = 8  # the fp8 error check's shape: at most this many experts, and at most half of them


def error_check_shape(shape: Shape) -> Shape:
    """The shape the fp8 error check runs at: the same D, F and rows per expert, at most half the experts
    (at most 8). Every expert computes independently, so a slice checks the same function; holding the
    reference's outputs while the fp8 path runs then costs less memory than the timed path at full size (at
    (128,7168,2048,256) the full-size check asked 14 GiB more than an 80 GB H100 had)."""
    experts = max(1, min(shape.experts // 2, ERROR_CHECK_EXPERTS))
    rows = shape.tokens_per_expert if shape.experts > 1 else max(1, shape.tokens_per_expert // 2)
    return Shape(experts, shape.hidden, shape.ffn, rows)


def rel_err(got: torch.Tensor, ref: torch.Tensor, chunk_rows: int = 4096) -> float:
    """||got - ref|| / ||ref|| in fp32, a slab of `chunk_rows` along dim 0 at a time (no full fp32 copies)."""
    diff2 = ref2 = 0.0
    for g, r in zip(got.split(chunk_rows), ref.split(chunk_rows)):
        r32 = r.float()
        diff2 += float((g.float() - r32).square().sum())
        ref2 += float(r32.square().sum())
    return (diff2 / max(ref2, 1e-60)) ** 0.5


def _fp8_errors(shape: Shape, cfg: BenchConfig, spec: Any, paths: list[str],
                log: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Relative errors ||a - ref|| / ||ref|| of y, dx and dw1 of each fp8 path against the eager path in the
    bench dtype (one fwd+bwd, no permute) at `error_check_shape(shape)`, outputs kept in the bench dtype and
    compared slab by slab: proof that every column computes the same function. A check that does not fit
    is reported as such (`{"error": ...}`), and the paths are still timed."""
    if not paths:
        return {}
    small = error_check_shape(shape)
    try:
        return _fp8_errors_at(small, cfg, spec, paths, log)
    except RuntimeError as e:
        message = as_oom(e)
    free(torch.device(cfg.device))
    log(f"{shape.label()}: fp8 error check at {small.label()}: {message}")
    return {p: {"error": message} for p in paths}


def _fp8_errors_at(shape: Shape, cfg: BenchConfig, spec: Any, paths: list[str],
                   log: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    inp = _inputs(shape, 1, torch.device(cfg.device), cfg.dtype, cfg.seed + 1)  # no permute: top-k unused
    # Seeded: under delayed scaling the grad's scale comes from the history an earlier call left, so an
    # unseeded dy whose amax happened to exceed it clipped and erred 0.19 in about one run of eight.
    gen = torch.Generator(device=inp.x_TD.device).manual_seed(cfg.seed + 2)
    dy = torch.randn(inp.x_TD.shape, generator=gen, device=inp.x_TD.device, dtype=inp.x_TD.dtype)

    def run(fn: Callable[..., torch.Tensor], w1: torch.Tensor) -> list[torch.Tensor]:
        x = inp.x_TD.detach().clone().requires_grad_()
        y = fn(x, inp.probs_T.detach())
        dx, dw1 = torch.autograd.grad(y, [x, w1], dy)
        return [y.detach(), dx, dw1]

    ref = run(lambda x, p: eager_expert_mlp(x, inp.w1_EHD, inp.w2_EDF, inp.offs_E, p), inp.w1_EHD)
    out: dict[str, Any] = {}
    for path in paths:
        fn, _ = fp8.expert_fn(path, inp, spec)
        errs = [rel_err(g, r) for g, r in zip(run(fn, inp.w1_EHD), ref)]
        out[path] = dict(zip(("y", "dx", "dw1"), errs))
        log(f"{shape.label()} {path}: rel err vs eager y={errs[0]:.2e} dx={errs[1]:.2e} dw1={errs[2]:.2e}")
    return out


def _row_line(row: dict[str, Any]) -> str:
    cells = " ".join(
        f"{p}={row[f'{p}_tflops']:.3g}" for p in ALL_PATHS if row[f"{p}_tflops"] is not None
    )
    return f"{row['shape']} {row['pass']}{' +permute' if row['permute'] else ''}: {cells} TFLOP/s"


def environment(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Device and software versions, for the report."""
    meta: dict[str, Any] = {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__}
    if device.type == "cuda":
        meta["device_name"] = torch.cuda.get_device_name(device)
        meta["cuda"] = torch.version.cuda
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            meta["triton"] = None
    else:
        meta["device_name"] = "cpu"
    return meta


def run(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> BenchResult:
    """Measure the ceiling, then every shape; returns all rows."""
    device = torch.device(cfg.device)
    unknown = set(cfg.paths) - set(ALL_PATHS)
    if unknown:
        raise ValueError(f"unknown paths {sorted(unknown)}; choose from {ALL_PATHS}")
    dense = dense_matmul(device, cfg.dtype, cfg.ceiling_size, cfg.seed)
    ceiling = dense_ceiling_tflops(device, cfg.dtype, cfg.ceiling_size, cfg.warmup, cfg.iters, cfg.seed)
    log(f"dense {cfg.ceiling_size}^3 {cfg.dtype} matmul: {ceiling:.3g} TFLOP/s")
    meta = environment(device, cfg.dtype)
    meta.update(
        warmup=cfg.warmup, iters=cfg.iters, rounds=cfg.rounds, ceiling_size=cfg.ceiling_size, paths=list(cfg.paths),
        sustained_seconds=cfg.sustained_seconds, sustained_rounds=cfg.sustained_rounds,
    )  # fmt: skip
    fp8_paths = [p for p in cfg.paths if p in FP8_PATHS]
    if fp8_paths:
        meta["fp8_modes"] = {
            p: fp8.recipe_mode(p, device) if fp8.available(p, device)[0] else "not run" for p in fp8_paths
        }  # fmt: skip
        meta["torchao"] = fp8.torchao_fn()[1] if "torchao_rowwise" in fp8_paths else None
        log(f"fp8 columns: {meta['fp8_modes']}; {meta['torchao']}")
    result = BenchResult(meta=meta, ceiling_tflops=ceiling)
    for shape in cfg.shapes:
        result.rows.extend(bench_shape(shape, cfg, ceiling, dense, result.notes, log, result.profiles))
    if result.rows:  # the ceiling again at the end: how far the device drifted over the run
        end = dense_ceiling_tflops(device, cfg.dtype, cfg.ceiling_size, cfg.warmup, cfg.iters, cfg.seed)
        meta["ceiling_end_tflops"] = end
        log(f"dense {cfg.ceiling_size}^3 matmul again at the end: {end:.3g} TFLOP/s")
    result.notes = sorted(set(result.notes))
    return result
