"""`moectl train CONFIG`: check the config against every rule, then train (or launch N processes)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from moectl.cli.base import app, command
from moectl.cli.options import ConfigArg, RunDirOpt, SetOpt, examples
from moectl.core.config.load import load_config
from moectl.core.errors import ConfigError

NprocOpt = Annotated[
    int, typer.Option("--nproc-per-node", min=1, help="Processes (GPUs) on this machine; >1 launches through torchrun.")
]


def refuse_on_rule_errors(cfg, world_size: int, console: Console) -> None:
    """Print every rule violation of `cfg` at `world_size`; raise one ConfigError if any is an error."""
    from moectl.cli.validate import print_violations
    from moectl.core.rules import check

    violations = check(cfg, world_size=world_size)
    errors = [v for v in violations if v.severity == "error"]
    if violations:
        print_violations(violations, console)
    if errors:
        raise ConfigError(
            "",
            None,
            f"the config breaks {len(errors)} rule(s) ({', '.join(v.rule for v in errors)}); not starting",
            "fix the rows above (moectl validate-config CONFIG shows them too)",
        )


@command(
    app,
    name="train",
    help="Train an MoE model from a YAML config."
    + examples(
        "moectl train configs/tiny.yaml",
        "moectl train configs/tiny.yaml --set train.train_iters=50 --set optimizer.lr=1e-3",
        "moectl train configs/tiny.yaml --nproc-per-node 2",
        "torchrun --nproc-per-node 8 -m moectl train configs/mixtral_8x7b_like.yaml",
    ),
)
def train_command(
    config: ConfigArg,
    set_: SetOpt = None,
    nproc_per_node: NprocOpt = 1,
    run_dir: RunDirOpt = None,
) -> None:
    from moectl.cli.launch import launch_local, reexec_args, under_torchrun

    overrides = list(set_ or [])
    if run_dir is not None:
        overrides.append(f"run_dir={run_dir}")
    cfg = load_config(config, overrides)
    # Inside torchrun every rank checks the rules (so all refuse together); only rank 0 prints.
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc_per_node
    rank0 = int(os.environ.get("RANK", "0")) == 0 if under_torchrun() else True
    console = Console(quiet=not rank0)
    refuse_on_rule_errors(cfg, world, console)
    if nproc_per_node > 1 and not under_torchrun():
        raise typer.Exit(launch_local(nproc_per_node, reexec_args()))

    from moectl.cli.progress import RichObserver
    from trainer.loop import train

    result = train(cfg, RichObserver(console))
    if rank0:
        how = f"stopped by {result.stopped_by}" if result.stopped_by else "done"
        last = f", final loss {result.losses[-1]:.4f}" if result.losses else ""
        ev = f", eval loss {result.eval_losses[-1][1]:.4f}" if result.eval_losses else ""
        console.print(f"[green]{how}[/]: {result.steps} steps{last}{ev}; metrics in {Path(cfg.run_dir) / 'metrics.jsonl'}")
