"""`moectl parity CONFIG --flag KEY=VALUE`: run a config with and without flags and say where they part.

A thin shell over `trainer.parity` (the lockstep runs and the comparison live there, tested without the
CLI): build OFF (the config with `--set`) and ON (OFF with every `--flag`), check both against the rules,
run, print a row per step and the verdict. Exit 0 when the runs are equal (bitwise, or within `--rtol`),
1 when they differ, 2 for bad usage, a config the rules refuse or data that cannot be read as configured. A
`--json PATH` whose folder takes no new file is bad usage, refused before any step (the option's check); a
write that fails after the run anyway (a full disk) is an error line, and the exit code stays the verdict's:
a script must not read "different" into an equal run because its report could not be saved.

With `--nproc-per-node N` it starts N processes through torchrun (as `train` does); every rank runs both
sides, rank 0 prints, and the verdict reaches this process through a file named in the children's
environment, so a difference is exit 1 here without torchrun reporting a failed child.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich import box
from rich.table import Table

from moectl.cli.base import app, command, data_errors_are_usage, report as report_error
from moectl.cli.console import make_console
from moectl.cli.options import ConfigArg, JsonPathOpt, SetOpt, examples
from moectl.cli.output import OutputError, write_json_file
from moectl.cli.train import NprocOpt, refuse_configs_once
from moectl.core.errors import UsageError

VERDICT_ENV = "MOECTL_PARITY_VERDICT"

FlagOpt = Annotated[
    list[str],
    typer.Option("--flag", "-f", metavar="KEY=VALUE", show_default=False,
                 help="A key to set in the ON run only (value parsed as YAML; repeatable)."),
]  # fmt: skip
StepsOpt = Annotated[int, typer.Option("--steps", "-n", min=1, help="Optimizer steps to run and compare.")]
RtolOpt = Annotated[
    Optional[float],
    typer.Option("--rtol", min=0.0, show_default=False,
                 help="Relative tolerance instead of bitwise: scalars |on-off| <= rtol*|off|, tensors "
                      "max|on-off| <= rtol*max|off|."),
]  # fmt: skip


@command(
    app,
    name="parity",
    help="Run a config twice on the same data and seed, OFF as written and ON with the flags; compare losses, "
    "grad norms, params, masters and optimizer state after every step; name the first step and tensor that "
    "differ. Exit 0 equal, 1 different, whether or not the --json file could be written."
    + examples(
        "moectl parity configs/tiny.yaml --flag moe.single_grouped_weight=false --steps 5",
        "moectl parity configs/tiny.yaml --flag parallel.overlap_grad_reduce=false --nproc-per-node 2",
        "moectl parity configs/tiny.yaml --flag moe.delay_wgrad_compute=true --rtol 1e-6 --json parity.json",
    ),
)
def parity_command(
    config: ConfigArg,
    flag: FlagOpt,
    set_: SetOpt = None,
    steps: StepsOpt = 10,
    nproc_per_node: NprocOpt = 1,
    rtol: RtolOpt = None,
    json_path: JsonPathOpt = None,
) -> None:
    from moectl.cli.launch import launch_local, reexec_args, under_torchrun
    from moectl.core.config.load import load_config

    for f in flag:
        if "=" not in f:
            raise UsageError(f"--flag {f!r} is not KEY=VALUE", "e.g. --flag moe.single_grouped_weight=false")
    common = list(set_ or [])
    off = load_config(config, common)
    on = load_config(config, [*common, *flag])
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc_per_node
    rank0 = int(os.environ.get("RANK", "0")) == 0 if under_torchrun() else True
    console = make_console(quiet=not rank0)
    refuse_configs_once([off, on], world, rank0)  # not again for ON what OFF has
    if nproc_per_node > 1 and not under_torchrun():
        raise typer.Exit(_launch(nproc_per_node, reexec_args(), launch_local))

    unchanged = _unchanged_flags(off, flag)
    if unchanged:
        console.print(f"[yellow]note[/]: the config already has {', '.join(unchanged)}: ON is OFF")

    from trainer.parity import run_parity

    table = Table(box=box.SIMPLE_HEAD, title=f"moectl parity {config} ({' '.join(flag)})")
    # "compared" counts what "N differ" counts: the loss, the grad norm and every tensor
    for col in ("step", "loss OFF", "loss ON", "grad norm OFF", "grad norm ON", "compared", "result"):
        table.add_column(col, justify="right" if col != "result" else "left")
    with data_errors_are_usage():  # both sides read their data as they are built, before the first step
        report = run_parity(off, on, steps, flags=list(flag), rtol=rtol)
    for r in report.records:
        result = "[green]equal[/]" if not r.differences else f"[red]{len(r.differences)} differ[/]"
        table.add_row(str(r.step), f"{r.off.loss:.6f}", f"{r.on.loss:.6f}", f"{r.off.grad_norm:.6f}",
                      f"{r.on.grad_norm:.6f}", str(r.compared + 2), result)  # fmt: skip
    console.print(table)
    first = report.first
    if first is None:
        console.print(f"[green]equal[/] ({report.mode}) over {steps} step(s): losses, grad norms, params, masters "
                      "and optimizer state")  # fmt: skip
    else:
        console.print(f"[red]different[/] ({report.mode}): first at {first.describe()}")
    code = 0 if report.equal else 1
    if json_path is not None and rank0:
        _write_report(json_path, {"config": str(config), **report.to_json()})
    verdict = os.environ.get(VERDICT_ENV)
    if verdict and rank0:  # a child of --nproc-per-node: the parent exits with the verdict
        Path(verdict).write_text(str(code))
        return
    if not verdict:
        raise typer.Exit(code)


def _write_report(path: Path, payload: dict[str, Any]) -> None:
    """Write the `--json` report; a failure is one error line, never the exit code (that is the verdict's)."""
    try:
        write_json_file(path, payload, indent=1)
    except OutputError as e:
        report_error(OutputError(e.message, f"{e.fix}; the exit code is still the verdict's (0 equal, 1 different)"))


def _unchanged_flags(off: Any, flags: list[str]) -> list[str]:
    """The flags whose key already has that value in OFF (then they change nothing)."""
    from moectl.core.config.load import yaml_scalar

    out = []
    for f in flags:
        key, _, value = f.partition("=")
        obj: Any = off
        for part in key.split("."):
            obj = getattr(obj, part, None)
        if obj == yaml_scalar(value):
            out.append(f)
    return out


def _launch(nproc: int, args: list[str], launch: Any) -> int:
    """Start the ranks with a verdict file in their environment; exit with what rank 0 wrote there."""
    with tempfile.TemporaryDirectory(prefix="moectl-parity-") as tmp:
        path = Path(tmp) / "verdict"
        os.environ[VERDICT_ENV] = str(path)
        try:
            failed = launch(nproc, args)
        finally:
            os.environ.pop(VERDICT_ENV, None)
        if failed:
            return failed  # a rank failed (2: it refused the input): it printed its error
        if not path.exists():
            return 1
        return int(path.read_text())
