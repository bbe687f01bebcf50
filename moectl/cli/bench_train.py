"""`moectl bench train CONFIG`: the real training step, ours against a compiled peer and torchtitan's recipe."""

from __future__ import annotations

import os
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from moectl.cli.base import command, data_errors_are_usage
from moectl.cli.bench import bench_app, write_json
from moectl.cli.console import make_console
from moectl.cli.options import ConfigArg, JsonPathOpt, NprocOpt, SetOpt, examples
from moectl.core.errors import UsageError

_HELP = (
    "End-to-end training step: the real trainer (the code `moectl train` runs) for warm-up, timed and profiled "
    "steps, side by side in one run: 'ours' (the config as given), 'compiled-peer' (each layer's norms, attention "
    "and router under regional torch.compile, our experts) and 'torchtitan-recipe' (the same, experts on "
    "moe.backend=grouped). Per column: tokens/s (total and per GPU), MFU on known GPUs, peak memory, step time, "
    "and the step's device time by category (GEMMs, attention, quantize, elementwise, copies, router, dispatch, "
    "loss, grad accumulation, optimizer, communication exposed/overlapped, idle) from a profiler pass."
    + examples(
        "moectl bench train configs/bench_reference.yaml --json runs/bench_train.json",
        "moectl bench train configs/bench_reference.yaml --column ours --column compiled-peer --steps 20",
        "moectl bench train configs/bench_reference.yaml --set mixed_precision.fp8=e4m3 --column ours",
        "moectl bench train configs/bench_reference.yaml --nproc-per-node 4 --set train.global_batch_size=32",
        "moectl bench train configs/tiny.yaml --quick",
    )
)


def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _ms_pct(ms: Optional[float], step_ms: Optional[float]) -> str:
    if ms is None or not step_ms:
        return "-"
    ms += 0.0  # -0.0 (no concurrent time, negated) prints as 0.0
    return f"{ms:.1f} ({100 * ms / step_ms:.0f}%)"


def _rows(result: Any) -> list[tuple[str, list[str]]]:
    """(label, one cell per column) for the table, in display order."""
    from moectl.bench.kernel_classes import CATEGORIES

    rows = result.rows
    ok = [r for r in rows if "error" not in r]

    def line(label: str, cell: Any) -> tuple[str, list[str]]:
        return label, [r["error"] if "error" in r else cell(r) for r in rows]

    out = [
        line("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
        line("tokens/s per GPU", lambda r: f"{r['tokens_per_s_per_gpu']:,.0f}"),
        line("MFU", lambda r: _fmt(None if r["mfu"] is None else 100 * r["mfu"], ".1f", "%")),
        line("ours / this (tokens/s)", lambda r: _fmt(r.get("ours_speedup"), ".2f", "x")),
        line("this / first column (tokens/s)", lambda r: _fmt(r.get("vs_first"), ".3f", "x")),
        line("step ms median (min-max)", lambda r: f"{r['step_ms']:.1f} ({r['step_ms_min']:.1f}-{r['step_ms_max']:.1f})"),
        line("peak memory (allocated, timed steps)", lambda r: _fmt(r["peak_mem_gib"], ".1f", " GiB")),
        line("reserved memory (whole run)", lambda r: _fmt(r.get("reserved_gib"), ".1f", " GiB")),
        line("warm-up s (compile)", lambda r: f"{r['warmup_s']:.1f}"),
        line("experts / compiled regions / graphs", lambda r: f"{r['expert_backend']} / {r['compiled_regions']} / "
             + ("yes" if r.get("cuda_graph") else "no")),
        line("max |loss - first column|", lambda r: _fmt(r.get("loss_vs_first_column"), ".2e")),
    ]
    if not any(r.get("profile") for r in ok):
        return out
    out.append(("device time per step, ms (% of step)", ["" for _ in rows]))

    def prof(key: str) -> Any:
        return lambda r: _ms_pct(r["profile"].get(key), r["step_ms"]) if r.get("profile") else "-"

    for key, label in CATEGORIES.items():
        if key == "comm":
            out.append(line("  communication, exposed", prof("comm_exposed_ms")))
            out.append(line("  communication, overlapped", prof("comm_overlapped_ms")))
            continue
        out.append(line(f"  {label}", lambda r, k=key: _ms_pct(r["profile"]["category_ms"][k], r["step_ms"])
                        if r.get("profile") else "-"))  # fmt: skip
    out += [
        line("  concurrent streams (counted twice above)", lambda r: _ms_pct(-r["profile"]["concurrent_ms"],
             r["step_ms"]) if r.get("profile") else "-"),  # fmt: skip
        line("  idle (no kernel running)", prof("idle_ms")),
        line("  kernels per step", lambda r: f"{r['profile']['kernels_per_step']:,.0f}" if r.get("profile") else "-"),
    ]
    return out


def _host_cpu() -> str:
    """The host CPU's model name (Linux `/proc/cpuinfo`, else `platform.processor()`): a column that launches
    eagerly (the peers) is bound by the host, and its step time moved 240 -> 306 ms between H100 machines
    (docs/benchmarks.md, twenty-second session), so a recorded number names its host."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or "unknown"


def render(result: Any, console: Console) -> None:
    """The result as one Rich table: a column per bench column, a row per measure."""
    meta = result.meta
    model = meta.get("model", {})
    versions = ", ".join(f"{k} {meta[k]}" for k in ("torch", "cuda", "nccl") if meta.get(k))
    title = (
        f"training step, {meta['config']}: {model.get('params', 0) / 1e6:,.1f}M params "
        f"({model.get('active_params', 0) / 1e6:,.1f}M active), {model.get('tokens_per_step', 0):,} tokens per step, "
        f"{meta['world_size']} x {meta['device_name']} ({versions}); host {meta.get('host_cpu', 'unknown')}"
    )
    timed = f"{meta['steps']} timed steps after {meta['warmup']} warm-up"
    split = (
        f"; device time from a profile of {meta['profile_steps']} more; categories sum kernel time over all streams, "
        "'concurrent streams' takes back the time two ran at once (overlapped communication included), idle = "
        "median step - busy device time (0 where the profiled steps were busier than the median; the rows then "
        "add up to more than the step, else to the step)"
    )
    # --profile-steps 0: no device-time rows, so no words about them
    caption = timed + (split if meta["profile_steps"] else "; no profile (--profile-steps 0)") + "".join(
        f"\n{n}" for n in result.notes)
    table = Table(title=title, caption=caption)
    table.add_column("")
    for r in result.rows:
        table.add_column(r["column"], justify="right")
    for label, cells in _rows(result):
        table.add_row(label, *cells)
    console.print(table)


@command(bench_app, name="train", help=_HELP, interruptible=True)
def train(
    config: ConfigArg,
    set_: SetOpt = None,
    nproc_per_node: NprocOpt = 1,
    steps: Annotated[Optional[int], typer.Option("--steps", min=1, help="Timed steps per column (default 10).")] = None,
    warmup: Annotated[
        Optional[int], typer.Option("--warmup", min=0, help="Untimed steps first (compiles happen here; default 3).")
    ] = None,
    profile_steps: Annotated[
        Optional[int], typer.Option("--profile-steps", min=0, help="Profiled steps after the timed ones (default 2; "
                                    "0 skips the device-time split).")
    ] = None,
    column: Annotated[
        Optional[list[str]],
        typer.Option("--column", help="Only these columns: ours, compiled-peer, torchtitan-recipe, cuda-graph, eager, adam, muon (repeatable; the first three by default; adam and muon: ours with that optimizer)."),
    ] = None,
    json_path: JsonPathOpt = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="The config's structure shrunk to a tiny CPU model, 2 steps: a CI smoke test.")
    ] = False,
) -> None:
    from moectl.bench import train_bench as tb
    from moectl.bench.train_columns import pick
    from moectl.cli.launch import launch_local, reexec_args, under_torchrun
    from moectl.cli.train import refuse_configs_once

    try:
        columns = pick(column)
    except ValueError as e:
        raise UsageError(str(e), "see `moectl bench train --help`") from None
    counts = tb.TrainBenchConfig.quick_steps() if quick else {}
    counts.update({k: v for k, v in (("steps", steps), ("warmup", warmup), ("profile_steps", profile_steps))
                   if v is not None})  # fmt: skip
    bench = tb.TrainBenchConfig(config=config, sets=list(set_ or []), columns=columns, quick=quick, **counts)
    launching = nproc_per_node > 1 and not under_torchrun()
    world = int(os.environ.get("WORLD_SIZE", "1")) if under_torchrun() else nproc_per_node
    rank0 = int(os.environ.get("RANK", "0")) == 0
    console = make_console(quiet=not rank0)
    # Checked before any process starts, as `train` does: a bad config or column under --nproc-per-node was
    # one error line per worker, after torchrun's start-up. The launcher's workers check again, silently.
    configs = [tb.column_config(bench, c, world) for c in columns]
    refuse_configs_once(configs, world, rank0)  # a violation of the file itself: once, not once per column
    if launching:
        raise typer.Exit(launch_local(nproc_per_node, reexec_args()))
    # every column reads the same data: data that cannot be read is no column's error row (the bench ended 0
    # with each column an error) but the input's
    with data_errors_are_usage():
        result = _run(bench, configs, world, console)
    if rank0:
        render(result, console)
        write_json(result, json_path, console)


def _run(bench: Any, configs: list[Any], world: int, console: Console) -> Any:
    """Run the columns; under `--quick` on the CPU the compiled columns use the aot_eager backend."""
    import torch

    from moectl.bench import train_bench as tb
    from trainer.compile import BACKEND_ENV
    from trainer.parallel.groups import destroy_distributed
    from trainer.runtime import pick_device

    device = pick_device(configs[0].train.device, int(os.environ.get("LOCAL_RANK", "0")))
    meta: dict[str, Any] = {
        "config": str(bench.config), "sets": bench.sets, "columns": [c.name for c in bench.columns],
        "steps": bench.steps, "warmup": bench.warmup, "profile_steps": bench.profile_steps, "quick": bench.quick,
        "world_size": world, "device": device.type, "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cuda": torch.version.cuda if device.type == "cuda" else None, "host_cpu": _host_cpu(),
    }  # fmt: skip
    notes = []
    set_backend = bench.quick and device.type == "cpu" and not os.environ.get(BACKEND_ENV)
    if set_backend:
        os.environ[BACKEND_ENV] = "aot_eager"
        notes.append("--quick on the CPU: compiled columns use torch.compile backend aot_eager (graph capture, no "
                     "code generation); their times say nothing about compiled speed")  # fmt: skip
    eager = [c.name for c in bench.columns if "train.cuda_graph=false" in c.overrides and c.name != "eager"]
    if device.type == "cuda" and eager:
        notes.append(f"{', '.join(eager)}: every kernel launched from the host, so their step times move with the "
                     "host CPU (named in the title) as well as the GPU")  # fmt: skip
    if device.type == "cpu" and bench.profile_steps:
        notes.append("on the CPU the 'device' is the host: op times include the profiler's per-op overhead, so the "
                     "split only shows that the attribution works")  # fmt: skip
    meta["compile_backend"] = os.environ.get(BACKEND_ENV) or "inductor"
    log = (lambda line: console.print(line, style="dim", highlight=False))
    try:
        result = tb.run(bench, configs, meta, log)
    finally:
        if set_backend:
            del os.environ[BACKEND_ENV]
        if world > 1:
            destroy_distributed()
    result.notes = notes + result.notes
    return result
