"""The start-up reservation of a run's background-save buffers, as the run reports it.

Allocating and page-locking a rank's staging buffer costs seconds at training scale (4.8 s for 12.8 GB per
rank on 2 H100s, docs/benchmarks.md), and until the ninth session the first background save paid it while
training stood still. A run that will save in the background now reserves the buffer before its first step
(`RunCheckpointer.reserve`): the cost moves to start-up, reported once here, and every save only copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpt.inspect import format_bytes


@dataclass(frozen=True)
class Reservation:
    """This rank's reservation at the start of a run (before `step`): `nbytes` of `how` host memory in
    `seconds` (sizing included: one gather of the logical state), or `why_not` when none was made."""

    step: int
    nbytes: int
    seconds: float
    how: str
    why_not: str = ""

    def line(self) -> str:
        """The run's log line."""
        if self.why_not:
            return (f"  checkpoints: no host buffers reserved at start-up ({self.why_not}); each save checks again "
                    "and runs synchronously while memory is short")
        return (f"  checkpoints: reserved {format_bytes(self.nbytes)} of {self.how} host memory for background saves "
                f"in {self.seconds:.2f} s at start-up (the saves then only copy into it)")

    def record(self) -> dict[str, Any]:
        """The `metrics.jsonl` record."""
        return {"step": self.step, "save_reserve_s": self.seconds, "save_reserve_bytes": self.nbytes,
                "save_reserve_how": self.how or None}  # fmt: skip
