"""What a run has done so far, for whoever must report on it when it fails or stops part-way.

The loop keeps a `RunState` up to date; the CLI hands one in and reads it after an error (a lost peer,
a timeout, a crash in step 14) to say where the run was and which checkpoint to resume from. A failed
run returns no `TrainResult`, so this is the only place that knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class RunState:
    """`step`: the step in flight (1-based), or the last one finished once the loop is over; None before the
    first. `checkpoint`: the newest committed checkpoint this run can be resumed from (saved by it, or the
    one it resumed from); None when there is none."""

    run_dir: Path | None = None
    step: int | None = None
    checkpoint: Path | None = None
    saved_by_this_run: bool = False
