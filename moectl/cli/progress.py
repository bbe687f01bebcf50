"""The training run as the CLI shows it (the engine's `RunObserver`): a live Rich progress bar on a terminal,
plain log lines everywhere else.

Off a terminal (a cluster job's log file, a pipe) a progress bar is drawn only once, at the end, so a log
held no per-step record until the run was over (issue 18). There `PlainObserver` prints one line every
`train.log_interval` steps, as Megatron and torchtitan do: step, loss, lr, grad norm, tokens/s, MFU (on a
known GPU), elapsed time and ETA. `observer_for` picks one of the two for a console.
"""

from __future__ import annotations

import contextlib
import math
import time
from datetime import timedelta
from typing import Any, Iterator, Union

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moectl.cli.console import make_console


class RichObserver:
    """A Rich progress bar with the numbers a user watches: loss, lr, grad norm, tokens/s, MFU, balance."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or make_console()
        self.progress: Progress | None = None
        self.task: Any = None

    @contextlib.contextmanager
    def running(self, total_steps: int, start_step: int) -> Iterator[None]:
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("loss [cyan]{task.fields[loss]}"),
            TextColumn("eval [magenta]{task.fields[eval]}"),
            TextColumn("lr {task.fields[lr]}"),
            TextColumn("gnorm {task.fields[gnorm]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("{task.fields[mfu]}"),
            TextColumn("bal {task.fields[bal]}"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        fields = dict(loss="-", eval="-", lr="-", gnorm="-", tps="-", mfu="", bal="-")
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, **fields)
        with self.progress:
            yield
        self.progress = None

    def started(self, lines: list[str]) -> None:
        head, *rest = lines
        self.console.print(head.replace("moectl train", "[bold]moectl train[/]", 1), highlight=False)
        for line in rest:
            self.console.print(line, highlight=False)

    def step(self, step: int, record: dict[str, Any]) -> None:
        """Advance to `step` (completed steps) and show the latest record's numbers."""
        if self.progress is None:
            return
        mfu = record.get("mfu")
        self.progress.update(
            self.task,
            completed=step,
            loss=f"{record['loss']:.4f}",
            lr=f"{record['lr']:.2e}",
            gnorm=f"{record['grad_norm']:.3f}",
            tps=f"{record['tokens_per_s']:,.0f}",
            mfu=f"MFU {100 * mfu:.1f}%" if mfu is not None else "",
            bal=f"{record.get('expert_balance', 1.0):.2f}",
        )

    def evaluated(self, step: int, eval_loss: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, eval=f"{eval_loss:.4f}")

    def log(self, message: str) -> None:
        """Print a line above the bar."""
        self.console.print(message, highlight=False)


class PlainObserver:
    """One plain line per `log_interval` steps (and per evaluation and log message), flushed as it is printed."""

    def __init__(self, console: Console, log_interval: int = 1) -> None:
        self.console = console
        self.log_interval = max(1, log_interval)
        self.total = 0
        self._t0 = 0.0
        self._first_step = 0

    def _print(self, line: str) -> None:
        # soft_wrap: a line is never broken, whatever the console's width
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    @contextlib.contextmanager
    def running(self, total_steps: int, start_step: int) -> Iterator[None]:
        self.total, self._first_step, self._t0 = total_steps, start_step, time.monotonic()
        yield

    def started(self, lines: list[str]) -> None:
        for line in lines:
            self._print(line)

    def step(self, step: int, record: dict[str, Any]) -> None:
        if step % self.log_interval:
            return
        elapsed = time.monotonic() - self._t0
        done = step - self._first_step
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        parts = [
            f"step {step}/{self.total}",
            f"loss {record['loss']:.4f}",
            f"lr {record['lr']:.3e}",
            f"grad norm {record['grad_norm']:.4f}",
            f"{record['tokens_per_s']:,.0f} tok/s",
        ]
        if record.get("mfu") is not None:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        parts += [f"elapsed {_clock(elapsed)}", f"ETA {_clock(eta)}"]
        self._print(" | ".join(parts))

    def evaluated(self, step: int, eval_loss: float) -> None:
        self._print(f"step {step}/{self.total} | eval loss {eval_loss:.4f}")

    def log(self, message: str) -> None:
        self._print(message)


#: past this an ETA is shown in days: timedelta overflows near 1e14 s (`train.train_iters=1e16` crashed the line)
_CLOCK_MAX_S = 100 * 365 * 86400


def _clock(seconds: float) -> str:
    """`0:02:05` (hours:minutes:seconds); `1.2e+09 days` past a century; `?` when not a number."""
    if math.isnan(seconds):
        return "?"
    if seconds > _CLOCK_MAX_S:
        return f"{seconds / 86400:.1e} days"
    return str(timedelta(seconds=round(max(0.0, seconds))))


def observer_for(console: Console, log_interval: int) -> Union[RichObserver, PlainObserver]:
    """The live bar on a terminal, plain lines every `log_interval` steps anywhere else."""
    return RichObserver(console) if console.is_terminal else PlainObserver(console, log_interval)
