"""Stopping on a signal: SIGTERM/SIGINT/SIGHUP set a flag, and the loop ends at a step boundary all ranks agree on.

A scheduler (Slurm, Kubernetes, torchrun's agent) asks a job to stop with SIGTERM and kills it a grace
period later; Ctrl-C sends SIGINT; a closed terminal or a dropped ssh session sends SIGHUP, whose default
ended the run at once with nothing saved (torchrun's agent forwards it to the workers like SIGTERM). None
may interrupt a step or a save half-way, so the handler only
records the signal; the loop checks it after each step, saves, and returns. The flag is agreed over all
ranks (`agreed`): a signal that reached one rank stops every rank after the same step, or the others would
wait for it in the next step's collectives until the timeout.

The first signal is acknowledged at once, in one line (`acknowledgement`), by the process the CLI asks to
(rank 0): a step can take minutes, and a Ctrl-C that nothing answers until it ends looks ignored.

A second SIGINT aborts at once (KeyboardInterrupt): the CLI ends the process without saving. A SIGINT within
`REPEAT_GRACE_S` of the first is taken as the same request, in every process: a parent that forwards a
Ctrl-C to its children sends it again to a process that already got it (a wrapper in the terminal's group;
torchrun's agent, whose forwarded copy follows the one a scheduler or `pkill -INT` sends every process of the
job), and that copy must not abort a run that was asked to stop and save. A launched worker leads its own
session, so no terminal reaches it: there the abort is the launcher's word, not a count of signals
(`abort_requested`, which moectl's launcher sets before it sends a later Ctrl-C on to each worker).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moectl.core.stop_signals import STOP_SIGNALS

REPEAT_GRACE_S = 2.0


class StopSignals:
    """Records SIGINT/SIGTERM/SIGHUP while entered; `signal` is the name of the first one received, or None.

    Entering again (nested, e.g. the CLI around the loop) keeps what was recorded: the loop honours a
    signal that came while the model was being built.

    `announce`: called from the handler with the first signal's `acknowledgement` line (rank 0's log); `saves`:
    whether the run will save when it stops, for that line. `repeat_grace_s`: how long a repeated SIGINT is
    the same request (default `REPEAT_GRACE_S`). `abort_requested`: for a launched worker, whether its
    launcher asked for the abort (then a later SIGINT aborts whenever it comes, and only then).
    """

    def __init__(self, announce: Callable[[str], None] | None = None, saves: bool = False,
                 repeat_grace_s: float = REPEAT_GRACE_S,
                 abort_requested: Callable[[], bool] | None = None) -> None:  # fmt: skip
        self.signal: str | None = None
        self._first_at = 0.0
        self._previous: list[dict[int, Any]] = []
        self._announce = announce
        self._saves = saves
        self.repeat_grace_s = repeat_grace_s
        self._abort_requested = abort_requested

    def __enter__(self) -> "StopSignals":
        saved: dict[int, Any] = {}
        for sig in STOP_SIGNALS:
            try:
                saved[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. under a test runner): no handler
                pass
        self._previous.append(saved)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None:
            if signum == signal.SIGINT and self._aborts():
                # One abort: a later press must not interrupt the clean-up that ends the process.
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                raise KeyboardInterrupt
            return
        self.signal = signal.Signals(signum).name
        self._first_at = time.monotonic()
        if self._announce is not None:
            try:
                self._announce(acknowledgement(self.signal, self._saves))
            except Exception:  # noqa: BLE001 - saying so must never break the run (a closed or busy stdout)
                pass

    def _aborts(self) -> bool:
        """Whether a SIGINT after the first aborts: the launcher's word for a launched worker, else its time."""
        if self._abort_requested is not None:
            try:
                return self._abort_requested()
            except Exception:  # noqa: BLE001 - no abort when the launcher's word cannot be read
                return False
        return time.monotonic() - self._first_at >= self.repeat_grace_s

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.pop().items():
            signal.signal(sig, handler)

    @property
    def signum(self) -> int | None:
        """The received signal's number (for the 128 + N exit code), or None."""
        return int(signal.Signals[self.signal]) if self.signal else None

    def agreed(self, group: Any, world_size: int) -> bool:
        """Whether any rank of the world has been asked to stop (collective when `world_size` > 1)."""
        return self.agree(group, world_size).stop

    def agree(self, group: Any, world_size: int, save_failed: bool = False) -> StepAgreement:
        """What every rank learns after a step (one collective when `world_size` > 1): whether any rank has
        been asked to stop, and whether any rank's background save has failed (`save_failed`: this rank's).

        A rank that learns of the stop only through the others takes on the highest signal number any rank
        received (SIGTERM over SIGINT), so every rank reports the same signal and exit code. The save failure
        rides on the same all-reduce, so every rank stops after the same step without a collective of its own.
        """
        if world_size == 1:
            return StepAgreement(self.signal is not None, save_failed)
        flags = torch.tensor([self.signum or 0, int(save_failed)], dtype=torch.int64)
        if torch.distributed.get_backend(group) == "nccl":
            flags = flags.cuda()
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group)
        got, failed = (int(x) for x in flags.tolist())
        if got and self.signal is None:
            self.signal = signal.Signals(got).name
            self._first_at = time.monotonic()
        return StepAgreement(got != 0, failed != 0)


def acknowledgement(signal_name: str, saves: bool) -> str:
    """The line said as soon as the first stop signal arrives: what the run will do, and for a Ctrl-C how
    to abort instead."""
    again = signal_name == "SIGINT"
    if saves:
        return (f"received {signal_name}: stopping after the current step and saving a checkpoint"
                + (" (Ctrl-C again to abort without saving)" if again else ""))  # fmt: skip
    return (f"received {signal_name}: stopping after the current step; nothing will be saved "
            f"(checkpoint.save_interval is not set{'; Ctrl-C again to abort at once' if again else ''})")


@dataclass(frozen=True)
class StepAgreement:
    """What all ranks agreed on after a step: stop (a signal reached some rank); a background save failed."""

    stop: bool
    save_failed: bool
