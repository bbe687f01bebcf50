"""How `moectl train` ends, as the exit code a scheduler or a script reads (README, docs/interface.md).

    0    finished: every step ran
    1    failed: a rank crashed, was killed or hung, a collective timed out, a non-finite loss, a bad checkpoint,
         out of memory (a valid config too big for this machine)
    2    bad usage or config (a data source that cannot be read at start-up included): nothing was trained
    3    stopped by a signal (SIGTERM, SIGINT, SIGHUP) after saving a checkpoint: resume with checkpoint.load
    128+N  stopped by signal N (143 SIGTERM, 130 SIGINT, 129 SIGHUP) with nothing saved (no checkpoint.save_interval):
         the shell's code for a death by that signal, since the steps are lost all the same; a warning says so.
         130 too for a second Ctrl-C, which aborts at once without saving (one line names the last checkpoint)

Every command: 141 (128 + SIGPIPE) when its reader closed stdout early (`moectl ... | head -1`), as a shell
tool killed by SIGPIPE ends; a `set -o pipefail` script must not read that as "violations" (1).

3 is distinct from 0 so that a job requeued after a preemption is told apart from one that finished, and
distinct from 1 so that it is not mistaken for a failure (Slurm requeues on any non-zero code if asked).

A rank of a multi-rank run ends through `end_process`, without the interpreter's finalization. A 2-rank
run printed "done" and then exited 1 in 6 of 26 runs (issue 18), one rank aborting with "terminate called
without an active exception". A core dump of it (here, 2 of 6 runs stopped by SIGTERM) showed why: a gloo
worker thread was still destroying a finished broadcast whose tensor Python had already dropped, needed
the GIL for that, found the interpreter finalizing, and was unwound out of a noexcept destructor.
`destroy_process_group` does not join those threads while the run's objects still reference the group,
and nothing can wait for that last release from Python, so the process leaves with `os._exit` once every
file is closed, the checkpoint committed and stdout/stderr flushed: there is no finalization to race.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn

FINISHED = 0
FAILED = 1
USAGE = 2
STOPPED_SAVED = 3


def reader_gone() -> int:
    """The code of a command whose stdout reader left (a closed pipe): 128 + SIGPIPE, as for any signal."""
    return stopped_unsaved(signal.SIGPIPE)


def stopped_unsaved(signum: int) -> int:
    """The code of a run a signal stopped before anything was saved: 128 + the signal's number."""
    return 128 + signum


def end_process(code: int) -> NoReturn:
    """Flush stdout, stderr and logging, then exit with `code` at once (no interpreter finalization)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said there
            pass
    logging.shutdown()
    os._exit(code)
