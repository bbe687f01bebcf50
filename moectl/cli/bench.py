"""`moectl bench ...`: measure the kernels and layers moectl runs, side by side with what a user would use."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from moectl.cli.base import app, command, new_app
from moectl.cli.console import make_console
from moectl.cli.options import JsonPathOpt, examples
from moectl.cli.output import write_json_file
from moectl.core.errors import UsageError
from moectl.core.summary import human_count

bench_app = new_app("bench", "Benchmarks: kernels and layers against the baselines a user would pick.")
app.add_typer(bench_app, name="bench")

_GROUPED_MLP_HELP = (
    "Routed-expert MLP throughput (GEMM TFLOP/s, forward and forward+backward): per-expert loop, "
    "torch._grouped_mm + eager SwiGLU, the same under torch.compile, moectl's grouped, fused and te (Transformer "
    "Engine, where installed) backends, "
    "against a dense matmul ceiling measured in the same run; with and without permute/unpermute. fp8 columns "
    "(a second table): moectl's fused backend under the fp8 tensorwise (weights quantized every call, or once as "
    "under fp8 param gather) and rowwise recipes, torch._scaled_grouped_mm rowwise unfused, and torchao's MoE fp8 "
    "path where torchao imports, and the te backend under fp8 tensorwise; emulated where the device has no native "
    "fp8 grouped GEMM (the table says so)."
    + examples(
        "moectl bench grouped-mlp --json runs/bench.json",
        "moectl bench grouped-mlp --shape 32,4096,1536,1024 --no-permute",
        "moectl bench grouped-mlp --shape 32,4096,1536,1024 --path fused --path fp8_tensorwise --profile fp8_tensorwise",
        "moectl bench grouped-mlp --no-fp8",
        "moectl bench grouped-mlp --quick",
    )
)


def _checked_device(device: Optional[str]) -> Optional[str]:
    """`--device` as the benches take it (cpu or cuda), or a one-line usage error: a wrong name, or cuda on a
    machine without a GPU, ended in a traceback from deep inside the bench."""
    if device is None:
        return None
    name = device.strip().lower()
    if name not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r}: expected cpu or cuda", "pass --device cpu or --device cuda")
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is visible", "pass --device cpu, or leave --device out")
    return name


def _cell(row: dict[str, Any], path: str, ran: Optional[list[str]] = None) -> str:
    """'TFLOP/s %-of-ceiling'; 'OOM' where the path or its whole row did not fit; '-' where it did not run."""
    if row.get(f"{path}_error") or (row.get("error") and (ran is None or path in ran)):
        return "OOM" if "out of memory" in (row.get(f"{path}_error") or row.get("error") or "") else "error"
    tflops = row[f"{path}_tflops"]
    if tflops is None:
        return "-"
    return f"{tflops:.3g} {row[f'{path}_pct_ceiling']:.0f}%"


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def render(result: Any, console: Console) -> None:
    """The result as one Rich table (a row per shape x pass x permute)."""
    from moectl.bench.grouped_mlp import PATHS

    meta = result.meta
    versions = ", ".join(f"{k} {meta[k]}" for k in ("torch", "cuda", "triton") if meta.get(k))
    table = Table(
        title=f"grouped expert MLP, {meta['dtype']} on {meta['device_name']} ({versions})",
        caption=(
            f"GEMM TFLOP/s (% of the dense {meta['ceiling_size']}^3 matmul: {result.ceiling_tflops:.3g} TFLOP/s); "
            f"median of {meta['iters']} calls in {meta['rounds']} interleaved rounds, after {meta['warmup']} warm-up"
            + "".join(f"\n{n}" for n in result.notes)
        ),
    )
    table.add_column("E,h,f,m")
    table.add_column("pass")
    for path in PATHS:
        table.add_column(path, justify="right")
    table.add_column("dense\nsame rounds", justify="right")
    table.add_column("fused/\neager", justify="right")
    table.add_column("fused/\ncompile", justify="right")
    table.add_column("fused/\nte", justify="right")
    for row in result.rows:
        dense = "-" if row["dense_row_tflops"] is None else f"{row['dense_row_tflops']:.3g}"
        table.add_row(
            f"{row['experts']},{row['hidden']},{row['ffn']},{row['tokens_per_expert']}", row["pass"] + (" +perm" if row["permute"] else ""), *(_cell(row, p, meta.get("paths")) for p in PATHS),
            dense, _ratio(row["fused_vs_eager"]), _ratio(row["fused_vs_compile"]), _ratio(row.get("fused_vs_te")),
        )  # fmt: skip
    console.print(table)
    render_fp8(result, console)


def _fp8_cell(row: dict[str, Any], path: str) -> str:
    """'ms (speed-up over bf16 fused)', marked when emulated."""
    if row.get("error") or row.get(f"{path}_error"):
        return _cell(row, path)
    ms = row.get(f"{path}_ms")
    if ms is None:
        return "-"
    ratio = f" {row[f'{path}_vs_fused']:.2f}x" if row.get(f"{path}_vs_fused") else ""
    emulated = " EMUL" if row.get(f"{path}_mode") == "emulated" else ""
    cell = f"{ms:.3g}{ratio}{emulated}"
    queued = row.get(f"{path}_queued_ms")
    if queued is not None:  # second line: the host-ahead regime (timing.queued_ms)
        q_ratio = f" {row[f'{path}_queued_vs_fused']:.2f}x" if row.get(f"{path}_queued_vs_fused") else ""
        behind = "*" if path in row.get("queued_host_behind", []) else ""
        cell += f"\nq {queued:.3g}{q_ratio}{behind}"
    steady = row.get(f"{path}_sustained_ms")
    if steady is not None:  # third line: steady state under continuous load (timing.sustained_ms)
        s_ratio = f" {row[f'{path}_sustained_vs_fused']:.2f}x" if row.get(f"{path}_sustained_vs_fused") else ""
        mhz = row.get(f"{path}_sustained_mhz")
        cell += f"\ns {steady:.3g}{s_ratio}" + (f"\n  {mhz:.0f} MHz" if mhz else "")
    return cell


def render_fp8(result: Any, console: Console) -> None:
    """The fp8 columns against our bf16 fused path (only when some fp8 path ran)."""
    from moectl.bench.grouped_mlp_fp8 import FP8_PATHS, LABELS

    ran = [p for p in FP8_PATHS if any(r.get(f"{p}_ms") is not None for r in result.rows)]
    if not ran:
        return
    meta = result.meta
    modes = meta.get("fp8_modes", {})
    errs = {}
    for r in result.rows:
        for p in ran:
            if r.get(f"{p}_rel_err") and (r["shape"], p) not in errs:
                errs[(r["shape"], p)] = r[f"{p}_rel_err"]
    caption = (
        f"median ms per call from an idle queue, and fused ms / this ms (> 1: fp8 faster); 'q': the same with "
        f"the host queued ahead of the device (one event pair over several calls; * host still fell behind); "
        + (
            f"'s': steady state, calls back to back for {meta.get('sustained_seconds', 0):g} s per path and round, "
            f"the second half timed, and the SM clock meanwhile (what the power limit holds under continuous load, "
            f"as in training); "
            if any(r.get(f"{p}_sustained_ms") for r in result.rows for p in ran) else ""
        )
        + "TFLOP/s in the JSON. "
        f"fp8 modes: {', '.join(f'{p} {m}' for p, m in modes.items())}"
        + (f"; {meta['torchao']}" if meta.get("torchao") else "")
        + "\nrel. error vs the eager path (y / dx / dw1, at up to 8 of the shape's experts): "
        + "; ".join(f"{s.split()[0]} {p} " + (f"{e['y']:.1e}/{e['dx']:.1e}/{e['dw1']:.1e}" if "y" in e else "OOM")
                    for (s, p), e in errs.items())
    )
    table = Table(title=f"fp8 expert MLP on {meta['device_name']} (vs moectl fused {meta['dtype']})", caption=caption)
    table.add_column("E,h,f,m")
    table.add_column("pass")
    table.add_column(f"fused\n{meta['dtype']}", justify="right")
    for p in ran:
        table.add_column(LABELS[p], justify="right")
    table.add_column("ours rw /\nsgmm rw", justify="right")
    table.add_column("ours rw /\ntorchao", justify="right")
    table.add_column("ours tw /\nTE tw", justify="right")
    for row in result.rows:
        cells = [f"{row['experts']},{row['hidden']},{row['ffn']},{row['tokens_per_expert']}",
                 row["pass"] + (" +perm" if row["permute"] else ""), _fp8_cell(row, "fused")]
        for p in ran:
            cells.append(_fp8_cell(row, p))
        cells += [_ratio(row.get("fp8_rowwise_vs_sgmm_rowwise")), _ratio(row.get("fp8_rowwise_vs_torchao_rowwise")),
                  _ratio(row.get("fp8_tensorwise_vs_te"))]  # fmt: skip
        table.add_row(*cells)
    console.print(table)
    for path, prof in getattr(result, "profiles", {}).items():
        console.print(
            f"profile {path} fwd+bwd at {prof['shape']}: {prof['total_ms']:.2f} ms of kernels per call, GEMMs "
            f"{prof['gemm_ms']:.2f} ms, the rest (quantize, activation, copies) {prof['other_ms']:.2f} ms; top kernels:",
            highlight=False,
        )
        for k in prof["top"]:
            console.print(f"  {k['ms']:8.3f} ms  {'GEMM ' if k['gemm'] else '     '}{k['name']}", highlight=False)


#: the ceiling's matmul size on a CPU (2 GFLOP: well under a second; the GPU's is 8192)
CPU_CEILING_SIZE = 1024


@command(bench_app, name="grouped-mlp", help=_GROUPED_MLP_HELP, interruptible=True)
def grouped_mlp(
    json_path: JsonPathOpt = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="Tiny shapes and few iterations (fp32 on CPU): a smoke test for CI.")
    ] = False,
    shape: Annotated[
        Optional[list[str]],
        typer.Option("--shape", help="E,h,f,m (experts, hidden, expert ffn, rows per expert); repeatable.", metavar="E,h,f,m"),
    ] = None,
    path: Annotated[
        Optional[list[str]],
        typer.Option("--path", help="Only these paths: loop, eager, compile, grouped, fused, te, fp8_tensorwise, "
                     "fp8_tensorwise_pq, fp8_tensorwise_pq_fa, fp8_delayed_pq_fa, fp8_rowwise, sgmm_rowwise, "
                     "torchao_rowwise, te_fp8_tensorwise (repeatable). Default: eager, compile, grouped, fused, te, "
                     "fp8_tensorwise, fp8_tensorwise_pq_fa, torchao_rowwise, te_fp8_tensorwise; --quick runs all."),
    ] = None,
    no_fp8: Annotated[bool, typer.Option("--no-fp8", help="Skip the fp8 columns.")] = False,
    profile: Annotated[
        Optional[list[str]],
        typer.Option("--profile", help="Profile this path's fwd+bwd at the first shape: kernel time, GEMMs vs the rest "
                     "(repeatable)."),
    ] = None,
    no_permute: Annotated[bool, typer.Option("--no-permute", help="Skip the rows with permute/unpermute.")] = False,
    iters: Annotated[Optional[int], typer.Option("--iters", min=1, help="Timed calls per number.")] = None,
    warmup: Annotated[Optional[int], typer.Option("--warmup", min=0, help="Untimed calls before timing.")] = None,
    device: Annotated[Optional[str], typer.Option("--device", help="cuda or cpu (default: cuda if present).")] = None,
    sustained: Annotated[
        Optional[float],
        typer.Option("--sustained-seconds", min=0.0, help="Seconds of back-to-back calls per path and round of the "
                     "steady-state column (CUDA; 0 skips it). Default 2."),
    ] = None,
    sustained_every_row: Annotated[
        bool,
        typer.Option("--sustained-every-row", help="Measure the steady state on every row, not only the fwd+bwd "
                     "rows without permute (the default; the regime takes most of a run's time)."),
    ] = False,
) -> None:
    from moectl.bench import grouped_mlp as gm

    device = _checked_device(device)
    cfg = gm.BenchConfig.quick_config(device) if quick else gm.BenchConfig()
    if device and not quick:
        cfg.device = device
    try:
        if shape:
            cfg.shapes = tuple(gm.Shape.parse(s) for s in shape)
        if path:
            unknown = sorted(set(path) - set(gm.ALL_PATHS))
            if unknown:
                raise ValueError(f"unknown path(s) {unknown}")
            cfg.paths = tuple(path)
        if no_fp8:
            cfg.paths = tuple(p for p in cfg.paths if p not in gm.FP8_PATHS)
        if profile:
            unknown = sorted(set(profile) - set(cfg.paths))
            if unknown:
                raise ValueError(f"--profile {unknown}: not among the paths run")
            cfg.profile = tuple(profile)
    except ValueError as e:
        raise UsageError(str(e), "see `moectl bench grouped-mlp --help`") from None
    cfg.permute = not no_permute
    cfg.iters = iters or cfg.iters
    cfg.warmup = cfg.warmup if warmup is None else warmup
    cfg.sustained_seconds = cfg.sustained_seconds if sustained is None else sustained
    cfg.sustained_every_row = sustained_every_row
    console = make_console()
    if not quick and cfg.device == "cpu":
        # The ceiling is a GPU's dense 8192^3 matmul, timed before any shape: on 2 cores it alone ran for minutes
        # with nothing printed, whatever --shape asked for.
        cfg.ceiling_size = CPU_CEILING_SIZE
        if not shape:  # the GPU's shapes at CPU speed: quiet for a long while
            console.print("note: these are GPU-sized shapes and run for a long time on the CPU before the first row; "
                          "--quick is the CPU smoke test", highlight=False)
    result = gm.run(cfg, log=lambda line: console.print(line, style="dim", highlight=False))
    render(result, console)
    write_json(result, json_path, console)


# ------------------------------------------------------------------------------------------------ optimizer-step
_OPTIMIZER_STEP_HELP = (
    "Optimizer step time on one GPU: moectl's DistributedOptimizer (fp32 masters, buffers; fp32 and bf16 params) "
    "against torch.optim.AdamW(fused=True) on the same ~805M parameters, with the bandwidth floor (bytes touched "
    "/ measured copy bandwidth) beside each, and the parts of moectl's step; Muon's step on the same params "
    "(Newton-Schulz in bf16 and in fp32, with its FLOP rate); then the post-step quantize of one "
    "grouped [E=128, out, in] expert weight (fp8 param gather) in one call against a per-expert loop."
    + examples(
        "moectl bench optimizer-step --json runs/opt.json",
        "moectl bench optimizer-step --quick",
    )
)


def render_optimizer_step(result: Any, console: Console) -> None:
    meta = result.meta
    table = Table(
        title=f"optimizer step, {meta['shape']['numel'] / 1e6:.1f}M params on {meta['device_name']} "
        f"(torch {meta['torch']})",
        caption="median of interleaved rounds; floor = bytes/param x params / copy bandwidth"
        + "".join(f"\n{n}" for n in result.notes),
    )  # fmt: skip
    for col in ("optimizer", "ms", "B/param", "GB/s", "floor ms", "% of floor", "vs torch fused"):
        table.add_column(col, justify="left" if col == "optimizer" else "right")
    def cell(value: Any, spec: str, suffix: str = "") -> str:  # Muon's rows have no byte floor: "-"
        return "-" if value is None else f"{value:{spec}}{suffix}"

    for r in result.rows:
        table.add_row(r["name"], f"{r['ms']:.3f}", cell(r["bytes_per_param"], "d"), cell(r["gbps"], ".0f"),
                      cell(r["floor_ms"], ".3f"), cell(r["pct_floor"], ".0f", "%"),
                      cell(r["throughput_vs_torch"], ".2f", "x"))
    console.print(table)
    if getattr(result, "quant_rows", None):
        E, o, i = meta["quant_shape"]
        q = Table(
            title=f"post-step quantize of one grouped expert weight [{E}, {o}, {i}] bf16 -> rowwise + columnwise "
            f"FP8 (on {meta['device_name']})",
            caption="median of interleaved rounds; floor = 4 B/param (bf16 read, two FP8 copies written) / copy bandwidth",
        )  # fmt: skip
        for col in ("quantize", "ms", "GB/s", "floor ms", "% of floor", "one call vs loop"):
            q.add_column(col, justify="left" if col == "quantize" else "right")
        for r in result.quant_rows:
            vs = "-" if r["grouped_speedup"] is None else f"{r['grouped_speedup']:.2f}x"
            q.add_row(r["name"], f"{r['ms']:.3f}", f"{r['gbps']:.0f}", f"{r['floor_ms']:.3f}", f"{r['pct_floor']:.0f}%", vs)
        console.print(q)


def write_json(result: Any, json_path: Optional[Path], console: Console) -> None:
    """Write a bench's result as JSON to `--json PATH` (its folder made by the option) and say so."""
    if json_path is not None:
        write_json_file(json_path, result.to_json())
        console.print(f"wrote {json_path}")


@command(bench_app, name="optimizer-step", help=_OPTIMIZER_STEP_HELP, interruptible=True)
def optimizer_step(
    json_path: JsonPathOpt = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="A tiny parameter set on the CPU: a smoke test for CI.")
    ] = False,
    device: Annotated[Optional[str], typer.Option("--device", help="cuda or cpu (default: cuda if present).")] = None,
    rounds: Annotated[Optional[int], typer.Option("--rounds", min=1, help="Interleaved timing rounds.")] = None,
) -> None:
    import torch

    from moectl.bench import optimizer_step as ob

    device = _checked_device(device)
    dev = device or ("cuda" if torch.cuda.is_available() and not quick else "cpu")
    cfg = ob.OptBenchConfig.quick(dev) if quick else ob.OptBenchConfig(device=dev)
    cfg.rounds = rounds or cfg.rounds
    console = make_console()
    result = ob.run(cfg, log=lambda line: console.print(line, style="dim", highlight=False))
    render_optimizer_step(result, console)
    write_json(result, json_path, console)


# ------------------------------------------------------------------------------------------------ param-gather
_PARAM_GATHER_HELP = (
    "The param all-gather of one step through moectl's buckets (sync coalesced and per bucket, async) against "
    "raw NCCL all-gathers of the same bytes (one call, per bucket, per bucket coalesced: time, GB/s, bus "
    "bandwidth, ratios to raw and to bf16), for bf16, fp8 and mxfp8 param storage, with fp8's deferred "
    "columnwise builds timed apart; then a real GPT-MoE step with overlap on / off / compute only (exposed "
    "communication). --mix picks the params: 'default' (803.5M, embedding + head 16.7%) or 'large-moe' (2.0B, "
    "3.3%: a real large MoE's share). Launches itself on --nproc-per-node GPUs."
    + examples(
        "moectl bench param-gather --nproc-per-node 2 --json runs/pg.json",
        "moectl bench param-gather --nproc-per-node 2 --mix large-moe --no-step --json runs/pg_large.json",
        "torchrun --nproc-per-node 4 -m moectl bench param-gather",
        "moectl bench param-gather --quick",
    )
)


def render_param_gather(result: Any, console: Console) -> None:
    meta = result.meta
    versions = ", ".join(f"{k} {meta[k]}" for k in ("torch", "cuda", "nccl") if meta.get(k))
    shape = meta["shape"]
    table = Table(
        title=f"param all-gather, {meta.get('mix', 'default')} mix: {shape['numel'] / 1e6:.1f}M params (embedding + "
        f"head {100 * shape.get('embedding_head_share', 0):.1f}%), {meta['world_size']} x {meta['device_name']} "
        f"({versions})",
        caption="slowest rank's median of interleaved rounds" + "".join(f"\n{n}" for n in result.notes),
    )  # fmt: skip
    for col in ("format", "gather", "buckets", "GB", "B/param", "ms", "algbw GB/s", "busbw GB/s", "vs raw",
                "vs bf16"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("format", "gather") else "right")
    for r in result.gather_rows:
        bpp = f"{r['bytes_per_param']:.3f}" + (f" ({r['qbytes_per_param']:.3f} q)" if r.get("qbytes_per_param") else "")
        busbw = "-" if r.get("busbw_gbps") is None else f"{r['busbw_gbps']:.0f}"
        table.add_row(r["format"], r["name"], str(r["buckets"]), f"{r['gbytes']:.3f}", bpp, f"{r['ms']:.3f}",
                      f"{r['algbw_gbps']:.0f}", busbw, _ratio(r.get("vs_raw")), _ratio(r.get("vs_bf16")))
    console.print(table)
    if result.step_rows:
        info = meta["step"]
        step = Table(
            title=f"training step, GPT-MoE {human_count(info['step_params'])} params, {info['tokens_per_rank']} "
            f"tokens per rank; {info['grad_reduce_gbytes']:.2f} GB grads reduced, "
            f"{info['param_gather_gbytes']:.2f} GB params gathered",
            caption="exposed = step - compute only (moectl's collectives as no-ops)",
        )  # fmt: skip
        for col in ("step", "ms", "exposed ms", "exposed % of step"):
            step.add_column(col, justify="left" if col == "step" else "right")
        for r in result.step_rows:
            step.add_row(r["name"], f"{r['ms']:.2f}", f"{r['exposed_ms']:.2f}", f"{r['exposed_pct']:.1f}%")
        console.print(step)


@command(bench_app, name="param-gather", help=_PARAM_GATHER_HELP, interruptible=True)
def param_gather(
    json_path: JsonPathOpt = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="Tiny params and model on the CPU (gloo): a smoke test for CI.")
    ] = False,
    nproc_per_node: Annotated[
        Optional[int],
        typer.Option("--nproc-per-node", min=1, help="Processes to launch (default: every visible GPU; 1 on CPU)."),
    ] = None,
    no_step: Annotated[bool, typer.Option("--no-step", help="Skip the training-step (overlap) table.")] = False,
    device: Annotated[Optional[str], typer.Option("--device", help="cuda or cpu (default: cuda if present).")] = None,
    mix: Annotated[
        str, typer.Option("--mix", help="Param mix: 'default' (803.5M) or 'large-moe' (2.0B, embedding + head 3.3%).")
    ] = "default",
) -> None:
    import torch

    from moectl.bench.param_mix import MIXES, mix_shape
    from moectl.cli.launch import launch_local, reexec_args, under_torchrun

    if mix not in MIXES:
        raise UsageError(f"--mix {mix!r} is not a param mix", f"use one of: {', '.join(sorted(MIXES))}")
    device = _checked_device(device)

    if not under_torchrun():
        n = nproc_per_node or (1 if quick or not torch.cuda.is_available() else torch.cuda.device_count())
        if n > 1:
            raise typer.Exit(launch_local(n, reexec_args()))

    import torch.distributed as dist

    from moectl.bench import param_gather as pg
    from moectl.bench.param_mix import ProcessGroup, device_for_rank

    dev = device_for_rank("cpu" if quick and device is None else device)
    cfg = pg.GatherBenchConfig.quick(dev.type, mix) if quick else pg.GatherBenchConfig.for_mix(mix, dev.type)
    if no_step:
        cfg.step = None
    with ProcessGroup(dev):
        main = dist.get_rank() == 0
        console = make_console(quiet=not main)
        if not quick and dev.type == "cpu":  # as grouped-mlp says: a GPU-sized run, silent for minutes on a CPU
            params = human_count(mix_shape(mix).numel())
            console.print(f"note: the {mix} mix ({params} params) is GPU-sized and runs for a long time on the CPU "
                          "before the first row; --quick is the CPU smoke test", highlight=False)  # fmt: skip
        result = pg.run(cfg, dev, log=lambda line: console.print(line, style="dim", highlight=False))
        render_param_gather(result, console)
        if main:
            write_json(result, json_path, console)
