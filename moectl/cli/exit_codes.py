"""How `moectl train` ends, as the exit code a scheduler or a script reads (README, docs/interface.md).

    0    finished: every step ran
    1    failed: a rank crashed, was killed or hung, a collective timed out, a non-finite loss, a bad checkpoint
    2    bad usage or config: nothing was trained
    3    stopped by a signal (SIGTERM, SIGINT) after saving a checkpoint: resume with checkpoint.load
    128+N  stopped by signal N (143 SIGTERM, 130 SIGINT) with nothing saved (no checkpoint.save_interval):
         the shell's code for a death by that signal, since the steps are lost all the same; a warning says so

3 is distinct from 0 so that a job requeued after a preemption is told apart from one that finished, and
distinct from 1 so that it is not mistaken for a failure (Slurm requeues on any non-zero code if asked).
"""

from __future__ import annotations

FINISHED = 0
FAILED = 1
USAGE = 2
STOPPED_SAVED = 3


def stopped_unsaved(signum: int) -> int:
    """The code of a run a signal stopped before anything was saved: 128 + the signal's number."""
    return 128 + signum
