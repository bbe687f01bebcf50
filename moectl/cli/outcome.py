"""Each rank's report to the launcher: how it ended, at which step, why, and what can be resumed.

torchrun's agent knows only exit codes, and prints a 25-50 line traceback for any non-zero one (issue 18).
The launcher (moectl/cli/launch.py) sets `MOECTL_OUTCOME_DIR` for its workers; each worker writes
`rank<N>.json` there as it ends, and the launcher turns the reports, together with the codes and signals
torchrun collected, into one line for the whole run. A rank that was killed writes nothing: its absence,
and what the others saw (a lost peer, a timeout), is what names it. Each worker also leaves `started<N>`
when its first step begins and `pid<N>` as it starts (the launcher sends a second Ctrl-C to that process,
after leaving `abort`, its word that this SIGINT aborts).

Written atomically (temp file + rename), so a reader never sees half a report.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

OUTCOME_DIR_ENV = "MOECTL_OUTCOME_DIR"

# kinds of an ended rank
FINISHED = "finished"
STOPPED = "stopped"  # by a signal
ABORTED = "aborted"  # by a second Ctrl-C: nothing saved after the step it was in
ERROR = "error"  # its own MoectlError (bad config, data, checkpoint, non-finite loss)
CRASH = "crash"  # an unexpected exception: a bug, with its traceback on stderr
TIMEOUT = "timeout"  # a collective timed out waiting for another rank
PEER_LOST = "peer-lost"  # a collective lost another rank (it exited or died)
PEER_FAILED = "peer-failed"  # stopped because another rank failed a check first


@dataclass
class Outcome:
    """One rank's report. `step`: the step in flight (or the last finished); `checkpoint`: the newest one the
    run can resume from; `message`: the one-line error (empty when it finished or stopped)."""

    rank: int
    kind: str
    exit_code: int
    step: Optional[int] = None
    message: str = ""
    checkpoint: Optional[str] = None
    signal: Optional[str] = None
    timeout_s: Optional[float] = None


def outcome_dir() -> Path | None:
    """Where this worker reports, when a moectl launcher started it."""
    d = os.environ.get(OUTCOME_DIR_ENV)
    return Path(d) if d else None


def _leave(name: str, text: str) -> None:
    """Write `name` with `text` into the launcher's report folder, whole (a temp file renamed over it), if a
    launcher started this worker; never raises: reporting must not fail a run."""
    d = outcome_dir()
    if d is None:
        return
    tmp = d / f".{name}.tmp"
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, d / name)
    except OSError:
        pass


def write_outcome(outcome: Outcome) -> None:
    """Write this rank's report, if a launcher asked for one (never raises: reporting must not fail a run)."""
    _leave(f"rank{outcome.rank}.json", json.dumps(asdict(outcome)))


def mark_started(rank: int) -> None:
    """Leave `started<rank>` for the launcher when this rank's first step begins (never raises): the verdict's
    evidence that a run a signal ended had got past start-up, since a rank killed there writes no report."""
    d = outcome_dir()
    if d is None:
        return
    try:
        (d / f"started{rank}").touch()
    except OSError:
        pass


def mark_pid(rank: int) -> None:
    """Leave `pid<rank>` (this process's id) for the launcher, which forwards a second Ctrl-C to each worker
    itself (`moectl.cli.launch`); never raises."""
    _leave(f"pid{rank}", str(os.getpid()))


def read_pids(d: Path) -> dict[int, int]:
    """Each worker's process id by rank (`mark_pid`), for those that have not reported how they ended: a
    reported rank is ending or gone, and its id may be another process's by now."""
    out: dict[int, int] = {}
    for p in d.glob("pid*"):
        rank = p.name.removeprefix("pid")
        if not rank.isdigit() or (d / f"rank{rank}.json").exists():
            continue
        try:
            out[int(rank)] = int(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    return out


ABORT = "abort"  # the launcher's word that a later SIGINT to a worker aborts the run (`request_abort`)


def request_abort(d: Path) -> None:
    """Leave the launcher's word that the run is to be aborted, before it sends the workers SIGINT: a worker
    takes a later SIGINT as an abort only with it (`trainer.stop.StopSignals`' `abort_requested`), so a SIGINT
    every process of the job got at once, and the launcher's forwarded copy of it, stay one stop request."""
    try:
        (d / ABORT).touch()
    except OSError:
        pass


def abort_requested(d: Path | None = None) -> bool:
    """Whether the launcher asked for the abort (`request_abort`) in report folder `d` (default: this worker's;
    False outside a launched run)."""
    d = d if d is not None else outcome_dir()
    return d is not None and (d / ABORT).exists()


CHECKPOINT = "checkpoint"  # the newest committed checkpoint of the run (`mark_checkpoint`)


def mark_checkpoint(path: str) -> None:
    """Leave the newest committed checkpoint the run can resume from (rank 0, as each one commits; never
    raises). A worker the launcher had to kill writes no report, and the abort's line must still name it."""
    _leave(CHECKPOINT, path)


def read_checkpoint(d: Path) -> str | None:
    """The checkpoint `mark_checkpoint` left, or None."""
    return _read(d / CHECKPOINT)


CHECKPOINT_ROOT = "checkpoint-root"  # the checkpoints folder the run saves into (`mark_checkpoint_root`)


def mark_checkpoint_root(path: str) -> None:
    """Leave the checkpoints folder this run saves into (rank 0, at start; never raises): only there may the
    launcher look for a step newer than the marked one. A resumed run marks the checkpoint it loaded, maybe in
    another run's folder, whose later steps are that run's, not this one's."""
    _leave(CHECKPOINT_ROOT, path)


def read_checkpoint_root(d: Path) -> str | None:
    """The folder `mark_checkpoint_root` left, or None."""
    return _read(d / CHECKPOINT_ROOT)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def read_started(d: Path) -> set[int]:
    """The ranks that began a step (`mark_started`)."""
    return {int(p.name.removeprefix("started")) for p in d.glob("started*") if p.name[7:].isdigit()}


def read_outcomes(d: Path) -> dict[int, Outcome]:
    """Every rank's report in `d` (ranks that wrote none are absent)."""
    out: dict[int, Outcome] = {}
    for p in sorted(d.glob("rank*.json")):
        try:
            o = Outcome(**json.loads(p.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            continue
        out[o.rank] = o
    return out
