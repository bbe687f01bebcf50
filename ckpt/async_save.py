"""`AsyncCheckpointer`: stage a rank's shards in host memory, then write, hash and commit them on a thread.

The caller blocks only for `HostStaging.stage` (device-to-host copies into reused buffers); a writer
thread then runs `ckpt.save.save_checkpoint` on the staged tensors, so a background save goes through the
very same commit protocol as a synchronous one: every rank writes and fsyncs its files, every rank votes,
rank 0 writes the manifest last, renames the folder and only then moves `latest`. Writing and hashing
release the GIL (`ckpt.shard_io`), so the thread costs the training thread little besides memory bandwidth.

The vote and the outcome broadcast are collectives, issued from the writer thread. They run on a process
group of their own (`group`: the caller creates it on every rank, gloo, before the first save), never on a
group the training thread uses: two threads issuing collectives on one group could interleave them
differently on different ranks and deadlock or mismatch. With its own group the commit happens as soon as
the slowest rank's files are durable, whatever step training has reached, and the training thread pays
nothing per step for it.

At most one save is in flight: `start` refuses while one is, so callers `wait` first (the staged buffers are
reused by the next save, and two commits could otherwise race for `latest`). A failed background save is
kept, not raised, until the owner asks (`poll`, `wait`): the training loop reports it at its next step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt.save import save_checkpoint
from ckpt.staging import Files, HostStaging


@dataclass
class SaveOutcome:
    """How a save ended: `path` committed, or `error`. Times in seconds: `blocking_s` the caller was stopped
    for (as the caller measured it), `background_s` from the writer's start to its commit or failure."""

    step: int
    path: Path | None
    error: BaseException | None
    blocking_s: float
    background_s: float
    nbytes: int  # bytes this rank wrote (its tensors' data)
    phases: dict[str, float] = field(default_factory=dict)  # background_s by part (`ckpt.save.PHASES`)

    @property
    def ok(self) -> bool:
        return self.error is None


class AsyncCheckpointer:
    """One rank's background saves, one at a time. `group`: the process group for the save's collectives
    (None for a single process); it must not be one any other thread issues collectives on."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.staging = HostStaging()
        self._thread: threading.Thread | None = None
        self._outcome: SaveOutcome | None = None
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> bool:
        """A save was started and its outcome not yet collected by `poll` or `wait`."""
        return self._thread is not None

    def start(self, root: Path, step: int, files: Files, meta: dict[str, Any], *, keep_last: int | None,
              blocking_since: float) -> float:
        """Copy `files` into host buffers, start the writer thread, and return the seconds blocked since
        `blocking_since` (a `time.perf_counter()` the caller took when it stopped training for this save)."""
        if self._thread is not None:
            raise RuntimeError("a background save is still in flight: wait() for it before starting another")
        staged = self.staging.stage(files)
        nbytes = sum(t.numel() * t.element_size() for ts in staged.values() for t in ts.values())
        blocking_s = time.perf_counter() - blocking_since
        self._outcome = None
        self._thread = threading.Thread(
            target=self._write, args=(root, step, staged, meta, keep_last, blocking_s, nbytes),
            name=f"moectl-ckpt-save-{step}", daemon=True,  # a process killed or aborting does not wait for it
        )  # fmt: skip
        self._thread.start()
        return blocking_s

    def _write(self, root: Path, step: int, staged: Files, meta: dict[str, Any], keep_last: int | None,
               blocking_s: float, nbytes: int) -> None:
        t0 = time.perf_counter()
        path: Path | None = None
        error: BaseException | None = None
        phases: dict[str, float] = {}
        try:
            path = save_checkpoint(root, step, staged, meta, group=self.group, keep_last=keep_last, phases=phases)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread, which reports it
            error = e
        with self._lock:
            self._outcome = SaveOutcome(step, path, error, blocking_s, time.perf_counter() - t0, nbytes, phases)

    def failed(self) -> bool:
        """The save in flight has finished, and failed (known on this rank without waiting)."""
        with self._lock:
            return self._outcome is not None and self._outcome.error is not None

    def poll(self, committed_only: bool = False) -> SaveOutcome | None:
        """The outcome of the save in flight if it has finished (once; then nothing is in flight), else None.
        `committed_only`: leave a failed save in flight (for `wait` to collect)."""
        with self._lock:
            finished = self._outcome is not None and (self._outcome.ok or not committed_only)
        return self.wait() if finished else None  # the thread has set its outcome: the join is immediate

    def wait(self) -> SaveOutcome | None:
        """Wait for the save in flight and return its outcome (None if none was in flight)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        outcome, self._outcome = self._outcome, None
        return outcome

    def close(self) -> None:
        """Free the staging buffers (after `wait`)."""
        self.staging.release()
