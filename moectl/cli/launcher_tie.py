"""A launched worker's tie to its launcher: a SIGTERM when the launcher dies.

torch's elastic agent starts each worker in a session of its own (so a terminal's Ctrl-C reaches only the
launcher, moectl/cli/launch.py), so when the launcher itself is killed outright (SIGKILL, the OOM killer)
nothing reaches the workers: in a user trial they trained on for about 30 steps, holding the run_dir lock (a
rerun was refused as "in use") and, on GPUs, their memory. Linux can tell them: `prctl(PR_SET_PDEATHSIG)`
sends the child a signal when its parent dies. The signal is SIGTERM, what a scheduler sends: the ranks agree
to stop after the step, save, and exit 3, so the run resumes from that checkpoint.

The kernel sends it when the thread that forked the child exits; torch's agent starts the workers from its
main thread (`LocalElasticAgent._start_workers`, from `run`), which lives as long as the launcher does.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

#: set by the launcher for its workers: its process id (a worker ties itself only to that parent)
LAUNCHER_PID_ENV = "MOECTL_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def tie_to_launcher() -> bool:
    """Ask the kernel to send this process SIGTERM when its launcher dies; returns whether the tie is set.

    Only for a process the launcher named (`LAUNCHER_PID_ENV`), on Linux, and only while that launcher is its
    parent (not a process a worker starts in turn, nor one behind a wrapper). A launcher that died before the
    tie (the worker was reparented during its start-up) gets the SIGTERM sent at once, as it would have come.
    Called first thing in a worker: a SIGTERM before the stop handler is installed ends it at once, with
    nothing trained; after, it stops the run at a step boundary (`trainer.stop.StopSignals`).
    """
    raw = os.environ.get(LAUNCHER_PID_ENV, "")
    if not raw.isdigit() or not sys.platform.startswith("linux"):
        return False
    launcher = int(raw)
    if os.getppid() != launcher:
        if not _alive(launcher):  # this worker's launcher is gone: nothing else would stop it
            os.kill(os.getpid(), signal.SIGTERM)
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # no prctl in this libc
        return False
    if os.getppid() != launcher:  # it died between the check and the tie
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: it exists
        return True
    return True
