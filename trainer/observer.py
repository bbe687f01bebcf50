"""What a run tells the person watching it, behind one small interface: the engine never draws anything.

The loop calls an observer (on the main rank only) as the run goes; the CLI's is a Rich progress bar
(moectl/cli/progress.py). Library users get `PrintObserver` (plain lines) or `SilentObserver`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol


class RunObserver(Protocol):
    """The run's events, in order: `running()` wraps the steps; `started` once; then per step `step`, maybe
    `evaluated`, and `log` for lines worth keeping (saves, skips, stops)."""

    def running(self, total_steps: int, start_step: int) -> contextlib.AbstractContextManager[None]: ...

    def started(self, lines: list[str]) -> None: ...

    def step(self, step: int, record: dict[str, Any]) -> None: ...

    def evaluated(self, step: int, eval_loss: float) -> None: ...

    def log(self, message: str) -> None: ...


class SilentObserver:
    """Shows nothing (validation runs, tests)."""

    @contextlib.contextmanager
    def running(self, total_steps: int, start_step: int) -> Iterator[None]:
        yield

    def started(self, lines: list[str]) -> None:
        pass

    def step(self, step: int, record: dict[str, Any]) -> None:
        pass

    def evaluated(self, step: int, eval_loss: float) -> None:
        pass

    def log(self, message: str) -> None:
        pass


class PrintObserver(SilentObserver):
    """Plain lines on stdout: the banner, every `every`-th step's loss, evaluations and log lines."""

    def __init__(self, every: int = 10) -> None:
        self.every = every

    def started(self, lines: list[str]) -> None:
        for line in lines:
            print(line, flush=True)

    def step(self, step: int, record: dict[str, Any]) -> None:
        if step % self.every == 0:
            print(f"step {step}: loss {record['loss']:.4f}, {record['tokens_per_s']:,.0f} tok/s", flush=True)

    def evaluated(self, step: int, eval_loss: float) -> None:
        print(f"step {step}: eval loss {eval_loss:.4f}", flush=True)

    def log(self, message: str) -> None:
        print(message, flush=True)
