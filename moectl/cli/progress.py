"""The training run as the CLI shows it: a banner and a live Rich progress bar (the engine's `RunObserver`)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class RichObserver:
    """A Rich progress bar with the numbers a user watches: loss, lr, grad norm, tokens/s, MFU, balance."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
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
