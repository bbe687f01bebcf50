"""`save_checkpoint`: every rank writes its shards, all agree, rank 0 commits. No half commit, no hang.

The protocol (PyTorch DCP's write -> gather results -> coordinator `finish`, with Megatron's rule that
the resume pointer moves only after the save is complete):

1. Group rank 0 draws a nonce and broadcasts it; every rank writes its files into the same
   `step_N.tmp-<nonce>/`, then fsyncs them (side by side) and the folder.
2. Vote: every rank all-gathers a JSON status (its error, or its file and tensor records). This is the
   "all-reduce of a status flag", carrying the reasons with it. Every rank applies the same checks to
   the same statuses (any error; steps differ; two ranks wrote one file; one tensor in two files), so
   all ranks reach the same verdict without another round. On failure every rank raises
   `CheckpointSaveError` naming the failing ranks, and rank 0 removes the in-flight folder. Each rank
   catches its own exceptions until the vote, so a failing rank still votes and nobody waits forever
   (DCP's `_DistWrapper` does the same; its tests require every rank to name exactly the bad ranks).
3. Commit, on rank 0: check every file is visible at its recorded size (catches ranks that do not share
   the filesystem), write manifest.json and fsync it (the commit marker, written last), rename the
   folder to `step_N` and fsync the root, replace `latest` atomically (its new content written beside it
   before the rename, so a kill between the two leaves it naming the committed step), apply retention.
4. Rank 0 broadcasts its outcome; every rank returns the step folder or raises the same error.

An interrupted save (a killed process) leaves only a `.tmp-` folder, which discovery ignores; `latest`
still names the previous step. One killed after the rename leaves `latest.tmp-<nonce>` naming the new step:
discovery takes that step, and the next `train` moves the file over `latest` (`ckpt.cleanup`).
Fault injection for tests: `ckpt.faults` (`MOECTL_CKPT_FAIL`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from ckpt import faults, manifest, names
from ckpt.collective import Comm, all_gather_json, broadcast_int, broadcast_json, comm_for
from ckpt.durable import fsync_dir, fsync_files, write_beside, write_file
from ckpt.retention import apply_retention
from ckpt.shards import prepare, write_shard
from moectl.core.errors import CheckpointError, MoectlError


class CheckpointSaveError(CheckpointError):
    """A save that failed on one or more ranks. `failures` maps global rank -> one-line reason."""

    def __init__(self, step: int, root: Path, failures: dict[int, str], committed: bool = False) -> None:
        self.failures = dict(sorted(failures.items()))
        self.ranks = list(self.failures)
        if len(self.ranks) == 1:
            (rank, why), = self.failures.items()
            where = f"rank {rank}: {why}"
        else:
            where = "ranks " + ", ".join(map(str, self.ranks)) + ": " + "; ".join(
                f"rank {r}: {w}" for r, w in self.failures.items()
            )
        if committed:
            super().__init__(
                f"checkpoint step {step} under {root} was committed but finishing the save failed on {where}",
                f"fix the cause, then resume with --set checkpoint.load={root}: it loads {names.step_dir_name(step)} "
                "(a `latest` not yet moved is finished by that run)",
            )
        else:
            super().__init__(
                f"saving checkpoint step {step} under {root} failed on {where}",
                "nothing was committed and latest is unchanged; fix the named rank's error and save again",
            )
        self.committed = committed


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    tensors_by_file: dict[str, dict[str, torch.Tensor]],
    meta: dict[str, Any],
    *,
    group: Any = None,
    keep_last: int | None = None,
    precondition: Callable[[], None] | None = None,
    phases: dict[str, float] | None = None,
) -> Path:
    """Save one checkpoint collectively; every rank of `group` must call it. Returns `root/step_N`.

    `tensors_by_file` maps this rank's file names (`model-NNNNN.safetensors`, `optim-NNNNN.safetensors`,
    unique across ranks) to their tensors (logical tensors or the slices the caller assembled; no name
    in two files). `meta` is the caller's part of the manifest (see `ckpt.manifest.check_meta`); only
    group rank 0's is used, other ranks may pass the same dict or `{}`. `keep_last` applies retention
    after the commit (rank 0 only). `precondition`, called on each rank once its files are durable and
    before the vote, must return for the save to commit (convert: its source verified meanwhile); what it
    raises fails the save on every rank like a write error. Raises `CheckpointSaveError` on every rank if
    any rank failed. `phases`, when given, receives this rank's seconds per part (`PHASES`), so a slow save
    can be told apart: copying tensors to the host, writing and hashing, the final fsync, then to the verdict
    (`precondition`, and waiting for the slowest rank), and the commit (rank 0's, which the others await).
    """
    clock = _Phases(phases)
    comm = comm_for(group)
    root = Path(root)
    # Agree on the in-flight folder first: a collective that cannot fail for local reasons.
    nonce = f"{broadcast_int(comm, secrets.randbits(62)):016x}"
    clock.lap("vote_s")  # waiting for every rank to start
    tmp: Path | None = None
    # Everything in `status` must be JSON, or this rank would fail inside the vote and the others hang.
    step_json = step if isinstance(step, int) else repr(step)
    status: dict[str, Any] = {"rank": comm.global_rank, "step": step_json, "error": None, "files": {}, "tensors": {}}
    try:
        final = root / names.step_dir_name(step)
        tmp = root / names.tmp_dir_name(step, nonce)
        _check_args(comm, final, tensors_by_file, meta, keep_last)
        tmp.mkdir(parents=True, exist_ok=True)
        for i, fname in enumerate(sorted(tensors_by_file)):
            tensors = prepare(tensors_by_file[fname], fname)  # on a device: the copies to the host
            clock.lap("prepare_s")
            # Not fsynced one by one: the next file's writes and hashes go on while the disk flushes this one.
            rec, trecs = write_shard(tmp / fname, tensors, fsync=False)
            del tensors
            clock.lap("write_s")
            status["files"][fname] = {**rec, "rank": comm.global_rank}
            status["tensors"].update(trecs)
            if i == 0:
                faults.check("write", comm.global_rank, step)
        fsync_files([tmp / fname for fname in tensors_by_file])
        fsync_dir(tmp)
        clock.lap("fsync_s")
        faults.check("finalize", comm.global_rank, step)
        if precondition is not None:
            precondition()
    except Exception as e:  # noqa: BLE001 - every local failure must reach the vote, or the others hang
        status = {**status, "error": describe(e), "files": {}, "tensors": {}}

    statuses = all_gather_json(comm, status)
    clock.lap("vote_s")
    failures = _verdict(statuses)
    if failures:
        if comm.rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(step, root, failures)

    assert tmp is not None
    outcome: dict[str, Any] = {"error": None, "committed": False}
    if comm.rank == 0:
        outcome = _commit(root, step, tmp, meta, statuses, keep_last)
    outcome = broadcast_json(comm, outcome)
    clock.lap("commit_s")
    if outcome["error"]:
        raise CheckpointSaveError(step, root, {statuses[0]["rank"]: outcome["error"]}, outcome["committed"])
    return root / names.step_dir_name(step)


PHASES = ("prepare_s", "write_s", "fsync_s", "vote_s", "commit_s")


class _Phases:
    """Seconds since the last lap, added to a named phase of the caller's dict (nothing when there is none)."""

    def __init__(self, out: dict[str, float] | None) -> None:
        self.out = out
        self.t = time.perf_counter()
        if out is not None:
            out.update({k: 0.0 for k in PHASES})

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        if self.out is not None:
            self.out[phase] += now - self.t
        self.t = now


def _check_args(comm: Comm, final: Path, tensors_by_file: Any, meta: Any, keep_last: Any) -> None:
    """Local argument checks; raising here fails the save on every rank through the vote."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
    if not isinstance(tensors_by_file, dict):
        raise TypeError(f"tensors_by_file must be a dict of file name -> tensors, got {type(tensors_by_file).__name__}")
    for fname in tensors_by_file:
        if not isinstance(fname, str) or not names.SHARD_RE.match(fname):
            raise ValueError(f"file name {fname!r} is not model-NNNNN.safetensors or optim-NNNNN.safetensors")
    if comm.rank == 0:
        errs = manifest.check_meta(meta)
        if errs:
            raise CheckpointError("; ".join(errs), "pass every manifest field in meta (see ckpt.manifest)")
        if final.exists():
            # Never overwrite a checkpoint implicitly: it may be the only good copy of that step.
            raise CheckpointError(
                f"{final} already exists", "delete it (or move it away) if it is stale, or save under another root"
            )


def describe(e: BaseException) -> str:
    """One line for a rank's failure."""
    try:
        text = e.one_line() if isinstance(e, MoectlError) else f"{type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001 - an exception whose str() fails must still be reported
        text = type(e).__name__
    return " ".join(text.split())


def _verdict(statuses: list[dict[str, Any]]) -> dict[int, str]:
    """The failing ranks and why; the same answer on every rank, since all see the same statuses."""
    failures = {s["rank"]: s["error"] for s in statuses if s["error"]}
    if failures:
        return failures
    step0 = statuses[0]["step"]
    for s in statuses:
        if s["step"] != step0:
            failures[s["rank"]] = f"saved step {s['step']} while rank {statuses[0]['rank']} saved step {step0}"
    file_owner: dict[str, int] = {}
    tensor_file: dict[str, str] = {}
    for s in statuses:
        for fname in s["files"]:
            if fname in file_owner:
                failures[s["rank"]] = f"wrote {fname}, which rank {file_owner[fname]} wrote too"
            file_owner.setdefault(fname, s["rank"])
        for tname, rec in s["tensors"].items():
            if tname in tensor_file:
                failures[s["rank"]] = f"tensor {tname!r} is in {rec['file']} and in {tensor_file[tname]}"
            tensor_file.setdefault(tname, rec["file"])
    return failures


def _commit(
    root: Path, step: int, tmp: Path, meta: dict[str, Any], statuses: list[dict[str, Any]], keep_last: int | None
) -> dict[str, Any]:
    """Rank 0: write the manifest, rename the folder, move `latest`, apply retention. Returns the outcome."""
    final = root / names.step_dir_name(step)
    renamed, pending = False, None
    try:
        files = {f: rec for s in statuses for f, rec in s["files"].items()}
        tensors = {t: rec for s in statuses for t, rec in s["tensors"].items()}
        for fname, rec in files.items():
            size = (tmp / fname).stat().st_size if (tmp / fname).is_file() else None
            if size != rec["size"]:
                raise CheckpointError(
                    f"{tmp / fname} written by rank {rec['rank']} is {size} bytes on rank 0, not {rec['size']}",
                    "every rank must write to a filesystem shared with rank 0",
                )
        faults.check("before_manifest", 0, step)
        write_file(tmp / names.MANIFEST, manifest.dumps(manifest.build(step, meta, files, tensors)))
        fsync_dir(tmp)
        # The next `latest` is on disk before the rename commits the step: a process killed between the rename
        # and the replace leaves it beside `latest`, naming this step, and discovery follows it. Written after
        # the rename (as before), a kill there left `latest` on the previous step with a committed step after
        # it, which a saving resume of the run refuses (trainer/run_dir.py): the job's rerun failed for good.
        pending = write_beside(root / names.LATEST, f"{final.name}\n".encode())
        os.rename(tmp, final)
        renamed = True
        fsync_dir(root)
        faults.check("before_latest", 0, step)
        os.replace(pending, root / names.LATEST)
        fsync_dir(root)
    except Exception as e:  # noqa: BLE001 - reported to every rank by the caller
        if pending is not None and not renamed:
            pending.unlink(missing_ok=True)
        if not renamed:
            shutil.rmtree(tmp, ignore_errors=True)
        return {"error": describe(e), "committed": renamed}
    try:
        apply_retention(root, keep_last)
    except Exception as e:  # noqa: BLE001 - the new checkpoint is good; an old one lingering is not fatal
        warnings.warn(f"checkpoint retention under {root} failed: {describe(e)}", RuntimeWarning, stacklevel=3)
    return {"error": None, "committed": True}
