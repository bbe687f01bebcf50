"""A run's saves: in the background where it works (`checkpoint.async_save`), reported once committed.

`RunCheckpointer.save` stops training only for what must happen on the training thread: wait for the
previous save if it is still in flight (at most one at a time), gather the logical state, compute the
probe, and copy this rank's share into reused host buffers (`ckpt.staging`). A writer thread then writes,
hashes and commits it through `ckpt.save.save_checkpoint`, the one commit protocol (`ckpt.async_save`).

The protocol's collectives (nonce, vote, outcome) run on a gloo group of their own, created on every rank
at the first background save, so the writer thread never shares a group with the training thread; every
later save of the run, background or not, votes on that group, so ranks that choose differently for one save
(one lacks host memory for the copy) still meet in the same collectives. A background save that failed is
found after a step: each rank tells the others in the all-reduce the loop already does for signals
(`StopSignals.agree`), so every rank stops after the same step and raises the same error (the vote gave
every rank the same verdict).

"Where it works": one process, or several with gloo available (every torch build on Linux has it), and
enough free host memory for this rank's share on top of what is in use (`MemAvailable`, times the
ranks on the node, plus `ckpt.host_copy.HEADROOM`: `memory_shortfall`). Otherwise that save is synchronous
and its line says why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from ckpt import find_latest, names
from ckpt.async_save import AsyncCheckpointer, SaveOutcome
from ckpt.host_copy import memory_shortfall, on_host
from ckpt.inspect import format_bytes
from ckpt.save import CheckpointSaveError, save_checkpoint
from ckpt.shard_io import io_threads
from moectl.core.config.schema import Config
from moectl.core.errors import CheckpointError
from trainer.checkpointing.reservation import Reservation
from trainer.checkpointing.save import checkpoint_parts
from trainer.engine.protocol import Engine
from trainer.parallel.groups import ParallelState, collective_timeout_s

BACKGROUND, SYNCHRONOUS = "background", "synchronous"


@dataclass
class SaveReport:
    """A committed save, as the run reports it (a log line and a `metrics.jsonl` record)."""

    step: int
    path: Path
    mode: str  # BACKGROUND or SYNCHRONOUS
    blocking_s: float  # training stopped for this long (waiting for the previous save included)
    background_s: float  # the writer thread's time to the commit (0 when synchronous)
    nbytes: int  # tensor bytes this rank wrote
    waited_s: float = 0.0  # part of blocking_s spent waiting for the previous save
    why: str = ""  # why a save that could have been in the background was not
    phases: dict[str, float] = field(default_factory=dict)  # this rank's seconds per part (`ckpt.save.PHASES`)

    def record(self) -> dict[str, Any]:
        """The `metrics.jsonl` record of this save."""
        return {"step": self.step, "checkpoint": self.path.name, "save_mode": self.mode,
                "save_blocking_s": self.blocking_s, "save_background_s": self.background_s,
                "save_bytes": self.nbytes, "save_waited_s": self.waited_s, "save_phases": self.phases}  # fmt: skip

    def line(self) -> str:
        """The run's log line for this save."""
        size = format_bytes(self.nbytes)
        waited = f", {self.waited_s:.2f} s of it waiting for the previous save" if self.waited_s >= 0.01 else ""
        if self.mode == BACKGROUND:
            return (f"saved {self.path}: training blocked {self.blocking_s:.2f} s{waited}, then this rank's {size} "
                    f"written, hashed and committed in the background in {self.background_s:.2f} s")
        why = f" ({self.why})" if self.why else ""
        return f"saved {self.path}: training blocked {self.blocking_s:.2f} s{waited}, synchronous{why}"


class RunCheckpointer:
    """The saves of one run on this rank (every rank has one; `save` is collective)."""

    def __init__(self, cfg: Config, engine: Engine, pstate: Optional[ParallelState], root: Path,
                 carried: Optional[dict[str, Any]] = None) -> None:
        self.cfg, self.engine, self.pstate, self.root = cfg, engine, pstate, root
        self.carried = carried or {}
        self.world = pstate.world_size if pstate is not None else 1
        self.why_not = _why_not_background(cfg, self.world)
        self._writer: AsyncCheckpointer | None = None
        self._waited: dict[int, float] = {}  # step -> seconds its save waited for the previous one
        self.last_committed: Path | None = None
        if cfg.checkpoint.save_interval:
            # MOECTL_CKPT_THREADS is read by the first save: a bad value is refused now, before any step, not
            # after every step up to that save has been trained (a synchronous save then lost them all)
            io_threads()

    def describe(self) -> str:
        """How this run saves, for its banner."""
        if self.why_not:
            return f"checkpoints: synchronous ({self.why_not})"
        return "checkpoints: in the background (checkpoint.async_save); training blocks only for the host copy"

    # --- saving -------------------------------------------------------------------------------------
    def reserve(self, step: int) -> Reservation | None:
        """At start-up, before training step `step + 1`: allocate (on CUDA: page-lock) the host buffers of
        the background saves now, so that the first save only copies (`ckpt.staging.HostStaging.reserve_for`).
        Sized by the very `checkpoint_parts` a save calls, so the first save fits them exactly. Collective
        (one gather of the logical state, and the commit group is made here); every rank calls it, and only
        when the run will save. None when this run does not save in the background."""
        if self.why_not:
            return None
        t0 = time.perf_counter()
        files, _ = checkpoint_parts(step, self.cfg, self.engine, self.pstate, 0.0, self.carried)
        writer = self._background_writer()
        why = memory_shortfall(writer.staging.new_bytes(files))
        if not why:
            writer.staging.reserve_for(files)
        del files  # the gathered state: only its shapes were needed
        if why:
            return Reservation(step, 0, time.perf_counter() - t0, "", why)
        return Reservation(step, writer.staging.nbytes, time.perf_counter() - t0, writer.staging.how)

    def save(self, step: int, probe_loss: Callable[[], float]) -> list[SaveReport]:
        """Save the state after `step` steps (collective). Returns the reports of what committed meanwhile:
        the previous background save if it had not been reported yet, and this save if it was synchronous
        (a background one is reported by `poll`/`finish` once committed). Raises the previous background
        save's error if it failed (every rank raises the same)."""
        t0 = time.perf_counter()
        reports = [r for r in [self._wait()] if r is not None]  # at most one in flight; raises its failure
        waited = time.perf_counter() - t0
        files, meta = checkpoint_parts(step, self.cfg, self.engine, self.pstate, probe_loss(), self.carried)
        keep_last = self.cfg.checkpoint.keep_last
        why = self.why_not
        if not why:
            writer = self._background_writer()
            why = memory_shortfall(writer.staging.new_bytes(files))
            if not why:
                writer.start(self.root, step, files, meta, keep_last=keep_last, blocking_since=t0)
                self._waited[step] = waited
                return reports
        group = self._writer.group if self._writer is not None else self._training_group()
        phases: dict[str, float] = {}
        t1 = time.perf_counter()
        with on_host(files) as staged:  # on CUDA: one page-locked copy, where memory allows (ckpt/host_copy.py)
            copy_s = time.perf_counter() - t1
            try:
                path = save_checkpoint(self.root, step, staged, meta, group=group, keep_last=keep_last,
                                       phases=phases)  # fmt: skip
            except CheckpointSaveError as e:
                raise _save_failure(e, step, self.root, self.last_committed, "") from e
            del staged
        phases["prepare_s"] += copy_s
        self.last_committed = path
        nbytes = sum(t.numel() * t.element_size() for ts in files.values() for t in ts.values())
        shown = "" if self.why_not else why  # the banner said why already
        reports.append(SaveReport(step, path, SYNCHRONOUS, time.perf_counter() - t0, 0.0, nbytes, waited, shown,
                                  phases))  # fmt: skip
        return reports

    def _background_writer(self) -> AsyncCheckpointer:
        if self._writer is None:
            group = None
            if self.world > 1:  # collective: every rank reaches its first save at the same step
                timeout = timedelta(seconds=collective_timeout_s(self.cfg.parallel))
                group = dist.new_group(list(range(self.world)), timeout=timeout, backend="gloo")
            self._writer = AsyncCheckpointer(group)
        return self._writer

    def _training_group(self) -> Any:
        return self.pstate.dp.pg if self.pstate is not None and self.world > 1 else None

    # --- outcomes -------------------------------------------------------------------------------------
    def failed(self) -> bool:
        """This rank's background save has finished and failed (what it tells the others after a step)."""
        return self._writer is not None and self._writer.failed()

    def poll(self) -> SaveReport | None:
        """The report of a background save that has committed since the last call (None if none has).

        A failed save is left in flight, never raised here: ranks learn of failures at different moments,
        so the failure is raised only where all ranks agree (after a step, `failed`; at `save`; at `finish`).
        """
        if self._writer is None:
            return None
        return self._report(self._writer.poll(committed_only=True))

    def finish(self) -> SaveReport | None:
        """Wait for the save in flight; its report (None if none was in flight). Raises its error if it failed."""
        return self._wait()

    def abandon(self) -> None:
        """On the way out of a failed run: let the save in flight finish (it may commit, and `last_committed`
        then names it) without raising its error over the run's own.

        A save can commit and still come back as an error here: rank 0 moves `latest` before it broadcasts
        the outcome, and a peer lost in between fails only the broadcast. So a failed outcome falls back on
        what the disk says (`find_latest`, what a resume would load) when that is newer."""
        if self._writer is None:
            return
        outcome = self._writer.wait()
        if outcome is not None and outcome.ok:
            self.last_committed = outcome.path
        elif outcome is not None:
            self._adopt_commit_on_disk()

    def _adopt_commit_on_disk(self) -> None:
        """After a failed save: take what the disk says (`find_latest`, what a resume would load) as the newest
        committed checkpoint when it is newer than `last_committed` (see `abandon`)."""
        try:
            on_disk = find_latest(self.root)
        except CheckpointError:  # a garbled `latest`: keep what this run knows it committed
            return
        if on_disk is not None and _step(on_disk) > (_step(self.last_committed) if self.last_committed else -1):
            self.last_committed = on_disk

    def committed(self) -> Path | None:
        """The newest checkpoint this run committed, counting a background save that has committed but not
        been reported yet, and one whose commit was cut before `latest` moved (what a resume loads: its pending
        `latest`); never waits for one in flight, and never raises (for a run being aborted)."""
        self.poll()
        self._adopt_commit_on_disk()
        return self.last_committed

    def close(self) -> None:
        """Free the host buffers (nothing may be in flight: after `finish` or `abandon`)."""
        if self._writer is not None:
            self._writer.close()

    def _wait(self) -> SaveReport | None:
        if self._writer is None:
            return None
        return self._report(self._writer.wait())

    def _report(self, outcome: SaveOutcome | None) -> SaveReport | None:
        if outcome is None:
            return None
        if outcome.error is not None:
            # The failed outcome is consumed here (the next save's wait, `finish`), so `abandon` no longer sees
            # it: a save that committed before a peer was lost in its outcome's broadcast is adopted now. A user
            # trial killed rank 0 just after it committed step 25; the survivor's line said "resume from
            # step_00000024", a step a saving resume from would then be refused.
            self._adopt_commit_on_disk()
            error = _as_run_error(outcome, self.root, self.last_committed)
            if error is outcome.error:
                raise error
            raise error from outcome.error
        assert outcome.path is not None
        self.last_committed = outcome.path
        waited = self._waited.pop(outcome.step, 0.0)
        return SaveReport(outcome.step, outcome.path, BACKGROUND, outcome.blocking_s, outcome.background_s,
                          outcome.nbytes, waited, phases=outcome.phases)


def _why_not_background(cfg: Config, world: int) -> str:
    """Why this run cannot save in the background at all ('' when it can)."""
    if not cfg.checkpoint.async_save:
        return "checkpoint.async_save=false"
    if world > 1 and not dist.is_gloo_available():
        return "this torch has no gloo backend for the background commit vote"
    return ""


def _as_run_error(outcome: SaveOutcome, root: Path, committed: Path | None) -> BaseException:
    """The run's one-line error for a failed background save. A save error becomes a CheckpointError naming
    the step, the rank and what `latest` still names; anything else (a lost peer in the vote, an injected
    crash) is raised as it is, for the loop's own handling of it."""
    e = outcome.error
    if not isinstance(e, CheckpointSaveError):
        return e  # type: ignore[return-value]
    return _save_failure(e, outcome.step, root, committed, "background ")


def _save_failure(e: CheckpointSaveError, step: int, root: Path, committed: Path | None, kind: str) -> CheckpointError:
    """A training run's one line for a save that failed (`kind`: "background " or ""): the step, the rank, what
    `latest` still names and how to resume. The save's own fix ("save again") fits `ckpt convert`, not a training
    run, whose user resumes; a save that did commit (only `latest` failed to move) keeps its own words."""
    if e.committed:
        return e
    latest = committed.name if committed is not None else _latest(root)
    still = f"latest still names {latest}" if latest else "no checkpoint of this run was committed"
    resume = f"; resume with --set checkpoint.load={root}" if latest else ""
    return CheckpointError(
        f"{kind}save of checkpoint step {step} failed: {e.message}; nothing of it was committed and {still}",
        f"fix that rank's error (disk space, permissions under {root}){resume}",
    )


def _step(folder: Path) -> int:
    return names.parse_step_dir(folder.name) or 0


def _latest(root: Path) -> str:
    try:
        return (root / names.LATEST).read_text().strip()
    except OSError:
        return ""
