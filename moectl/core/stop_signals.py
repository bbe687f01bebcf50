"""The signals that ask a moectl process to stop, for every part that handles them (the trainer, the launcher,
the CLI's commands): SIGINT (Ctrl-C), SIGTERM (a scheduler) and, where the platform has it, SIGHUP (a closed
terminal or ssh session). Torch-free, so `moectl --help` stays light."""

from __future__ import annotations

import signal

STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None
)
