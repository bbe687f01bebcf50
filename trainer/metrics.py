"""What a run records and shows: `metrics.jsonl`, optional TensorBoard, and the live Rich progress bar.

`metrics.jsonl` holds one JSON object per line. Python's json writes floats with `repr`, i.e. the
shortest string that round-trips, so losses compare bit for bit across runs (interface.md).
Only rank 0 writes or prints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class MetricsWriter:
    """Appends train and eval records to `run_dir/metrics.jsonl` (and TensorBoard when enabled)."""

    def __init__(self, run_dir: Path, *, jsonl: bool = True, tensorboard: bool = False, resume: bool = False) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a" if resume else "w") if jsonl else None
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is an optional extra
                from moectl.errors import MoectlError

                raise MoectlError(
                    f"logging.tensorboard is on but TensorBoard is not importable ({e})",
                    "pip install 'moectl[tensorboard]' or set logging.tensorboard=false",
                ) from None
            self._tb = SummaryWriter(str(run_dir / "tb"))

    def write(self, record: dict[str, Any]) -> None:
        """Write one record; `step` is required."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def expert_balance(tokens_per_expert: list[list[int]]) -> float:
    """Load imbalance over MoE layers: mean over layers of max(tokens) / mean(tokens); 1.0 is perfect."""
    ratios = []
    for counts in tokens_per_expert:
        total = sum(counts)
        if total:
            ratios.append(max(counts) / (total / len(counts)))
    return sum(ratios) / len(ratios) if ratios else 1.0


class ProgressDisplay:
    """A Rich progress bar with the numbers a user watches: loss, lr, grad norm, tokens/s, MFU, balance."""

    def __init__(self, total_steps: int, start_step: int, console: Console, enabled: bool = True) -> None:
        self.enabled = enabled
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
            console=console,
            disable=not enabled,
            transient=False,
        )
        fields = dict(loss="-", eval="-", lr="-", gnorm="-", tps="-", mfu="", bal="-")
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, **fields)

    def __enter__(self) -> "ProgressDisplay":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, record: dict[str, Any]) -> None:
        """Advance to `step` (completed steps) and show the latest record's numbers."""
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

    def show_eval(self, eval_loss: float) -> None:
        self.progress.update(self.task, eval=f"{eval_loss:.4f}")

    def log(self, message: str) -> None:
        """Print a line above the bar."""
        if self.enabled:
            self.progress.console.print(message)
