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

A second SIGINT aborts at once (KeyboardInterrupt): the CLI ends the process without saving. A process in a
terminal's foreground group whose parent forwards the Ctrl-C to it too (torchrun's agent did, before torch
started each worker in a session of its own; any wrapper that forwards signals) sees one press twice, so
there a SIGINT within `REPEAT_GRACE_S` of the first is taken as the same press. A process that leads its own
session has no terminal to hear a Ctrl-C from (torch's elastic `SubprocessHandler` starts every worker so:
`start_new_session`), and moectl's launcher forwards each press once, so every SIGINT such a worker gets is a
press of its own. Which case holds is checked when `StopSignals` is made, not assumed of a torch version.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)
REPEAT_GRACE_S = 2.0


class StopSignals:
    """Records SIGINT/SIGTERM/SIGHUP while entered; `signal` is the name of the first one received, or None.

    Entering again (nested, e.g. the CLI around the loop) keeps what was recorded: the loop honours a
    signal that came while the model was being built.

    `announce`: called from the handler with the first signal's `acknowledgement` line (rank 0's log); `saves`:
    whether the run will save when it stops, for that line. `repeat_grace_s`: how long a repeated SIGINT is
    the same press (default: `REPEAT_GRACE_S`, or 0 in a process that leads its own session).
    """

    def __init__(self, announce: Callable[[str], None] | None = None, saves: bool = False,
                 repeat_grace_s: float | None = None) -> None:
        self.signal: str | None = None
        self._first_at = 0.0
        self._previous: list[dict[int, Any]] = []
        self._announce = announce
        self._saves = saves
        self.repeat_grace_s = repeat_grace_s if repeat_grace_s is not None else _repeat_grace_s()

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
            if signum == signal.SIGINT and time.monotonic() - self._first_at >= self.repeat_grace_s:
                raise KeyboardInterrupt
            return
        self.signal = signal.Signals(signum).name
        self._first_at = time.monotonic()
        if self._announce is not None:
            try:
                self._announce(acknowledgement(self.signal, self._saves))
            except Exception:  # noqa: BLE001 - saying so must never break the run (a closed or busy stdout)
                pass

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


def _repeat_grace_s() -> float:
    """0 in a process that leads its own session (no terminal reaches it, so each SIGINT is one press),
    else `REPEAT_GRACE_S`."""
    try:
        return 0.0 if os.getsid(0) == os.getpid() else REPEAT_GRACE_S
    except (AttributeError, OSError):  # no sessions here (Windows): keep the grace
        return REPEAT_GRACE_S


@dataclass(frozen=True)
class StepAgreement:
    """What all ranks agreed on after a step: stop (a signal reached some rank); a background save failed."""

    stop: bool
    save_failed: bool
