"""`moectl train CONFIG`: check the config against every rule, then train (or launch N processes).

How a run ends is the exit code (moectl/cli/exit_codes.py): 0 finished, 1 failed, 2 bad usage or config,
3 stopped by a signal after saving, 128+N stopped by signal N with nothing saved (130 also: aborted by a
second Ctrl-C). A rank of a multi-rank run prints its error as one line (prefixed with its rank); under this
CLI's own launcher it reports to the launcher instead (moectl/cli/outcome.py), which prints one line for the
whole run.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any, Optional, Sequence

import typer
from rich.console import Console

from moectl.cli import exit_codes
from moectl.cli import outcome as O
from moectl.cli.base import app, command, report
from moectl.cli.console import make_console, say
from moectl.cli.launcher_tie import tie_to_launcher
from moectl.cli.options import ConfigArg, NprocOpt, RunDirOpt, SetOpt, examples
from moectl.cli.verdict import aborted_line
from moectl.core.config.load import load_config
from moectl.core.config.schema import Config
from moectl.core.environment import says_it_once
from moectl.core.errors import ConfigError, DataError, MoectlError

OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Train afresh into a run_dir that holds another run's metrics.jsonl, replacing it and config.yaml "
        "(its checkpoints are never deleted; a run that saves still refuses to save over them).",
    ),
]

HELP = (
    "Train an MoE model from a YAML config.\n\n"
    "Results go to run_dir (the config's run_dir, or --run-dir): config.yaml (the resolved config), "
    "metrics.jsonl (one JSON record per train.log_interval steps, and per evaluation), and with "
    "checkpoint.save_interval set, checkpoints/step_NNNNNNNN/ and checkpoints/latest (also saved on SIGTERM).\n\n"
    "Resume a run: the same command with --set checkpoint.load=RUN_DIR/checkpoints (it continues from the "
    "latest checkpoint to train.train_iters). A fresh run refuses a run_dir holding another run's metrics "
    "unless --overwrite.\n\n"
    "Exit codes: 0 finished, 1 failed, 2 bad usage or config, 3 stopped by SIGTERM/SIGINT/SIGHUP after saving "
    "(resume it), 128+N stopped by signal N with nothing saved. A second Ctrl-C aborts at once without saving "
    "(130)."
)


def refuse_on_rule_errors(cfg: Config, world_size: int, console: Console, refusal: str = "not starting",
                          this_machine: bool = True, shown: set[tuple[str, str, str, str]] | None = None) -> None:
    """Print every rule violation of `cfg` at `world_size`; raise one ConfigError (ending in `refusal`) if any
    is an error. `this_machine=False`: the config is for another machine (import-hf writes one to train
    elsewhere), so the rules about this one's GPU and Transformer Engine are left to `train` there.

    `shown`: for a command that checks several configs of one file (bench train's columns, parity's OFF and ON),
    the violations printed so far, which are not printed again (a missing data.path was one warning per column)
    and to which this call adds its own."""
    from moectl.cli.validate import print_violations
    from moectl.core.rules import check, check_elsewhere

    violations = check(cfg, world_size=world_size) if this_machine else check_elsewhere(cfg, world_size)
    errors = [v for v in violations if v.severity == "error"]
    if shown is not None:
        new = [v for v in violations if (v.rule, v.severity, v.message, v.fix) not in shown]
        shown.update((v.rule, v.severity, v.message, v.fix) for v in violations)
        violations = new
    if violations:  # a table on a terminal, a line each in a log (a run's output usually lands in one)
        print_violations(violations, console, lines=not console.is_terminal)
    if errors:
        raise ConfigError(
            "",
            None,
            f"the config breaks {len(errors)} rule(s) ({', '.join(v.rule for v in errors)}); {refusal}",
            "fix each violation above (moectl validate-config CONFIG shows them too)",
        )


def refuse_configs_once(configs: Sequence[Config], world_size: int, rank0: bool) -> None:
    """`refuse_on_rule_errors` over the configs a command builds from one file (bench train's columns, parity's OFF
    and ON, bench ckpt's one): each violation printed once, by rank 0, and not by a launched worker (its
    launcher checked them before it started any process)."""
    console = make_console(quiet=not rank0 or not says_it_once(os.environ))
    shown: set[tuple[str, str, str, str]] = set()
    for cfg in configs:
        refuse_on_rule_errors(cfg, world_size, console, shown=shown)


def _launcher_threads(cfg: Config) -> int | None:
    """OMP_NUM_THREADS for the launcher's workers on a CPU run (trainer/threads.py's rule); None on GPUs."""
    import torch

    from trainer.threads import choose_cpu_threads

    if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()):
        return None
    return choose_cpu_threads(cfg.train.cpu_threads).threads


@command(
    app,
    name="train",
    help=HELP
    + examples(
        "moectl train configs/tiny.yaml",
        "moectl train configs/tiny.yaml --set train.train_iters=50 --set optimizer.lr=1e-3",
        "moectl train configs/tiny.yaml --set checkpoint.save_interval=50 --set checkpoint.load=runs/tiny/checkpoints",
        "moectl train configs/tiny.yaml --nproc-per-node 2",
        "torchrun --nproc-per-node 8 -m moectl train configs/mixtral_8x7b_like.yaml",
    ),
)
def train_command(
    config: ConfigArg,
    set_: SetOpt = None,
    nproc_per_node: NprocOpt = 1,
    run_dir: RunDirOpt = None,
    overwrite: OverwriteOpt = False,
) -> None:
    from moectl.cli.launch import launch_train, reexec_args, under_torchrun

    tie_to_launcher()  # a launched worker: its launcher killed outright stops it as a scheduler's SIGTERM would
    cfg = load_config(config, list(set_ or []))
    if run_dir is not None:  # as given, not through YAML: "" stays "" (rule MOE068), any path survives
        cfg = dataclasses.replace(cfg, run_dir=run_dir)
    # Inside torchrun every rank checks the rules (so all refuse together); only rank 0 prints, and not even
    # rank 0 when this CLI's launcher printed them already.
    torchrun = under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else nproc_per_node
    rank = int(os.environ.get("RANK", "0")) if torchrun else 0
    console = make_console(quiet=rank != 0, outlive_stdout=True)
    # the run's kind of console: a reader that closed stdout must not end the run before it starts
    refuse_on_rule_errors(cfg, world, make_console(quiet=rank != 0 or O.outcome_dir() is not None, outlive_stdout=True))
    from trainer.run_dir import check_config_not_replaced

    check_config_not_replaced(config, cfg)
    if nproc_per_node > 1 and not torchrun:
        result = launch_train(nproc_per_node, reexec_args(), _launcher_threads(cfg),
                              saves=cfg.checkpoint.save_interval is not None)
        if result.line:
            say(f"error: {result.line}", "red")
        raise typer.Exit(result.code)
    code = _train_here(cfg, console, rank, world, overwrite)
    if world > 1:
        exit_codes.end_process(code)  # a rank that joined a gloo group: see exit_codes.py for why
    raise typer.Exit(code)


def _metrics_where(cfg: Config) -> str:
    """Where the run's metrics went, for its last line: only the files it wrote (`logging.jsonl: false` writes
    no metrics.jsonl, and the line named it all the same)."""
    run_dir = Path(cfg.run_dir)
    files = ((run_dir / "metrics.jsonl", cfg.logging.jsonl), (run_dir / "tb", cfg.logging.tensorboard))
    where = [str(path) for path, on in files if on]
    if not where:
        return "no metrics file (logging.jsonl and logging.tensorboard are off)"
    return f"metrics in {' and '.join(where)}"


def _start_marking_state(rank: int, checkpoint_root: Optional[Path] = None) -> Any:
    """A `RunState` that tells the launcher when its first step begins (`outcome.mark_started`) and, on rank 0,
    which checkpoint is the newest committed one (`outcome.mark_checkpoint`) and the run's own checkpoints
    folder, `checkpoint_root` (`outcome.mark_checkpoint_root`)."""
    from trainer.run_state import RunState

    if rank == 0 and checkpoint_root is not None:
        O.mark_checkpoint_root(str(checkpoint_root))

    class StartMarking(RunState):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "step" and value is not None and getattr(self, "step", None) is None:
                O.mark_started(rank)
            if name == "checkpoint" and rank == 0 and value is not None and value != getattr(self, name, None):
                O.mark_checkpoint(str(value))
            super().__setattr__(name, value)

    return StartMarking()


def _out_of_memory(e: BaseException, cfg: Config, step: int | None, rank: int, world: int, launched: bool,
                   report_to_launcher: Any) -> int:
    """Report an allocation failure of the run (CUDA's or the CPU allocator's) as one line naming where it
    happened and what to shrink; return exit code 1 (a failure: the config itself is valid)."""
    from moectl.bench.oom import oom_message

    where = "before the first step" if step is None else f"at step {step}"
    line = (f"{oom_message(e)} ({where}). fix: make train.micro_batch_size or the model smaller, or run on more "
            f"memory; moectl validate-config CONFIG --gpu-memory GIB estimates what a rank holds")
    report_to_launcher(O.ERROR, exit_codes.FAILED, line)
    if os.environ.get("MOECTL_DEBUG") == "1":
        traceback.print_exc()
    if not launched:  # the launcher prints one line for the whole run
        say(f"error: {f'rank {rank}: ' if world > 1 else ''}{line}", "red")
    return exit_codes.FAILED


def _train_here(cfg: Config, console: Console, rank: int, world: int, overwrite: bool) -> int:
    """Train on this process and return its exit code, reporting to a launcher when one asked.

    Never raises: errors are printed here (one line; a bug's traceback as Python would print it), so a
    multi-rank worker can end through `exit_codes.end_process` whatever happened. A run aborted by a second
    Ctrl-C does not return: it ends the process here, with 130 (one process too).
    """
    from moectl.cli.progress import observer_for
    from trainer.loop import train
    from trainer.parallel.failures import CollectiveFailure, PeerFailedError
    from trainer.run_state import RunState
    from trainer.stop import StopSignals

    launched = O.outcome_dir() is not None
    state = _start_marking_state(rank, Path(cfg.run_dir) / "checkpoints") if launched else RunState()
    if launched:
        O.mark_pid(rank)  # the launcher forwards a second Ctrl-C to this process itself
    saves = bool(cfg.checkpoint.save_interval)
    observer = observer_for(console, cfg.train.log_interval)

    def report_to_launcher(kind: str, code: int, message: str = "", signal_name: str | None = None,
                           timeout_s: float | None = None) -> None:
        O.write_outcome(O.Outcome(rank=rank, kind=kind, exit_code=code, step=state.step, message=message,
                                  checkpoint=str(state.checkpoint) if state.checkpoint else None,
                                  signal=signal_name, timeout_s=timeout_s))  # fmt: skip

    # Entered before the model is built: a SIGTERM during start-up stops the run at its first step boundary.
    # Rank 0 says at once what a signal will do; the step in flight can take long.
    with StopSignals(announce=observer.log if rank == 0 else None, saves=saves,
                     abort_requested=O.abort_requested if launched else None) as stop:  # fmt: skip
        try:
            result = train(cfg, observer, stop=stop, overwrite=overwrite, state=state)
        except MoectlError as e:
            if isinstance(e, CollectiveFailure):
                kind = O.TIMEOUT if e.kind == "timeout" else O.PEER_LOST
            else:
                kind = O.PEER_FAILED if isinstance(e, PeerFailedError) else O.ERROR
            code = e.exit_code
            if isinstance(e, DataError) and state.step is None:  # the data as configured: nothing was trained
                code = exit_codes.USAGE
            report_to_launcher(kind, code, e.one_line(), timeout_s=getattr(e, "timeout_s", None))
            if os.environ.get("MOECTL_DEBUG") == "1":
                traceback.print_exc()
            if not launched:  # the launcher prints one line for the whole run
                report(e, f"rank {rank}: " if world > 1 and not e.message.startswith("rank ") else "")
            return code
        except KeyboardInterrupt:  # a second Ctrl-C: abort now, without saving
            code = exit_codes.stopped_unsaved(signal.SIGINT)
            ckpt = str(state.checkpoint) if state.checkpoint else None
            report_to_launcher(O.ABORTED, code, signal_name="SIGINT")
            if not launched:  # the launcher prints one line for the whole run
                where = f"rank {rank}: " if world > 1 else ""
                say(f"error: {where}{aborted_line(state.step, ckpt, saves)}", "red")
            # Ended here, as a multi-rank worker always ends: a background save still in flight must not go on
            # to commit while the interpreter finalizes, after this line named the checkpoint before it.
            exit_codes.end_process(code)
        except Exception as e:
            from moectl.bench.oom import is_oom  # here, not at the top: torch is loaded by now, not by `moectl -h`

            if is_oom(e):  # a config too big for this machine, not a bug: one line, as for any failure
                return _out_of_memory(e, cfg, state.step, rank, world, launched, report_to_launcher)
            # a bug: keep its traceback (moectl/core/errors.py), tell the launcher in one line
            report_to_launcher(O.CRASH, exit_codes.FAILED, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
            traceback.print_exc()
            return exit_codes.FAILED
        if result.stopped_by:
            code = exit_codes.STOPPED_SAVED if result.saved else exit_codes.stopped_unsaved(result.stop_signum or 15)
            report_to_launcher(O.STOPPED, code, signal_name=result.stopped_by)
        else:
            code = exit_codes.FINISHED
            report_to_launcher(O.FINISHED, code)
    if launched:
        # Done: a SIGTERM the agent sends while this process exits (after another rank's exit code 3) must
        # not turn a clean stop into a death by signal.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == 0:
        how = f"stopped by {result.stopped_by}" if result.stopped_by else "done"
        last = f", final loss {result.losses[-1]:.4f}" if result.losses else ""
        ev = f", eval loss {result.eval_losses[-1][1]:.4f}" if result.eval_losses else ""
        color = "green" if code in (exit_codes.FINISHED, exit_codes.STOPPED_SAVED) else "yellow"
        steps = f"{result.steps} step" + ("" if result.steps == 1 else "s")
        console.print(f"[{color}]{how}[/]: {steps}{last}{ev}; {_metrics_where(cfg)}")
    sys.stdout.flush()
    return code
