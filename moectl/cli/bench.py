"""`moectl bench ...`: measure the kernels and layers moectl runs, side by side with what a user would use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from moectl.cli.base import app, command, new_app
from moectl.cli.options import JsonPathOpt, examples
from moectl.errors import UsageError

bench_app = new_app("bench", "Benchmarks: kernels and layers against the baselines a user would pick.")
app.add_typer(bench_app, name="bench")

_GROUPED_MLP_HELP = (
    "Routed-expert MLP throughput (GEMM TFLOP/s, forward and forward+backward): per-expert loop, "
    "torch._grouped_mm + eager SwiGLU, the same under torch.compile, moectl's grouped and fused backends, "
    "against a dense matmul ceiling measured in the same run; with and without permute/unpermute."
    + examples(
        "moectl bench grouped-mlp --json runs/bench.json",
        "moectl bench grouped-mlp --shape 32,4096,1536,1024 --no-permute",
        "moectl bench grouped-mlp --quick",
    )
)


def _cell(row: dict[str, Any], path: str) -> str:
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
    for row in result.rows:
        table.add_row(
            f"{row['experts']},{row['hidden']},{row['ffn']},{row['tokens_per_expert']}", row["pass"] + (" +perm" if row["permute"] else ""), *(_cell(row, p) for p in PATHS),
            f"{row['dense_row_tflops']:.3g}", _ratio(row["fused_vs_eager"]), _ratio(row["fused_vs_compile"]),
        )  # fmt: skip
    console.print(table)


@command(bench_app, name="grouped-mlp", help=_GROUPED_MLP_HELP)
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
        typer.Option("--path", help="Only these paths: loop, eager, compile, grouped, fused (repeatable)."),
    ] = None,
    no_permute: Annotated[bool, typer.Option("--no-permute", help="Skip the rows with permute/unpermute.")] = False,
    iters: Annotated[Optional[int], typer.Option("--iters", min=1, help="Timed calls per number.")] = None,
    warmup: Annotated[Optional[int], typer.Option("--warmup", min=0, help="Untimed calls before timing.")] = None,
    device: Annotated[Optional[str], typer.Option("--device", help="cuda or cpu (default: cuda if present).")] = None,
) -> None:
    from moectl.bench import grouped_mlp as gm

    cfg = gm.BenchConfig.quick_config(device) if quick else gm.BenchConfig()
    if device and not quick:
        cfg.device = device
    try:
        if shape:
            cfg.shapes = tuple(gm.Shape.parse(s) for s in shape)
        if path:
            unknown = sorted(set(path) - set(gm.PATHS))
            if unknown:
                raise ValueError(f"unknown path(s) {unknown}")
            cfg.paths = tuple(path)
    except ValueError as e:
        raise UsageError(str(e), "see `moectl bench grouped-mlp --help`") from None
    cfg.permute = not no_permute
    cfg.iters = iters or cfg.iters
    cfg.warmup = cfg.warmup if warmup is None else warmup
    console = Console()
    result = gm.run(cfg, log=lambda line: console.print(line, style="dim", highlight=False))
    render(result, console)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        console.print(f"wrote {json_path}")
