"""Removing what interrupted saves and deletes left behind: `step_N.tmp-<nonce>` and `step_N.trash-<nonce>`.

A save killed before its commit leaves a `.tmp-` folder, and retention killed half-way leaves a `.trash-`
one (ckpt/save.py, ckpt/retention.py). Discovery ignores both, but nothing removed them: they stayed on
disk forever, each as large as a checkpoint. A run removes them when it starts (rank 0, before any save
of its own can be in flight, under the run_dir lock of trainer/run_dir.py).

Only folders this product wrote are removed: the name must match exactly and every entry inside must be
a file a save writes (`model-/optim-NNNNN.safetensors`, `manifest.json`). A folder holding anything else is left alone and reported, never deleted.

A save killed after its rename but before moving `latest` leaves `latest.tmp-<nonce>` naming the step it
committed (ckpt/save.py); discovery already takes that step, and the same start finishes the commit: the file
is moved over `latest`. Pending files of saves killed before their rename (naming no committed step) go.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ckpt import names
from ckpt.discovery import find_latest, read_latest
from ckpt.durable import fsync_dir
from moectl.core.errors import CheckpointError


@dataclass
class Cleanup:
    """What `remove_interrupted_saves` did: removed folders, and folders left alone with the reason."""

    removed: list[Path] = field(default_factory=list)
    kept: list[tuple[Path, str]] = field(default_factory=list)
    latest: Path | None = None  # the step `latest` was moved to, finishing a save killed before it moved it


def _ours(entry: Path) -> bool:
    """Whether a save writes this entry: a shard file or the manifest, as a plain file."""
    name = entry.name
    return bool(names.SHARD_RE.match(name) or name == names.MANIFEST) and entry.is_file() and not entry.is_symlink()


def _leftover_name(name: str) -> bool:
    """Whether `name` is what an interrupted save (`.tmp-`) or delete (`.trash-`) leaves."""
    return bool(names.TMP_DIR_RE.match(name) or names.TRASH_DIR_RE.match(name))


def _not_ours(p: Path) -> str | None:
    """Why `p`, named as a leftover, is no folder of checkpoint files a save left (then it is never removed),
    or None when it is one."""
    if p.is_symlink() or not p.is_dir():
        return "not a plain folder"
    strangers = [e.name for e in p.iterdir() if not _ours(e)]
    if strangers:
        return f"holds {', '.join(sorted(strangers)[:3])}, which no save writes"
    return None


def only_interrupted_saves(root: Path) -> list[str]:
    """The names of the interrupted saves that are all `root` holds (a checkpoints folder a killed command left
    behind, nothing committed in it), else []: also for a `root` that is empty, no folder or unreadable."""
    try:
        entries = sorted(root.iterdir())
        left = entries and all(_leftover_name(p.name) and _not_ours(p) is None for p in entries)
        return [p.name for p in entries] if left else []
    except OSError:
        return []


def remove_interrupted_saves(root: str | os.PathLike[str]) -> Cleanup:
    """Delete the interrupted-save and half-deleted folders under `root` that hold only checkpoint files."""
    root = Path(root)
    done = Cleanup()
    if not root.is_dir():
        return done
    for p in sorted(root.iterdir()):
        if not _leftover_name(p.name):
            continue
        why = _not_ours(p)
        if why is not None:
            done.kept.append((p, why))
            continue
        shutil.rmtree(p, ignore_errors=True)
        if p.exists():
            done.kept.append((p, "could not be removed"))
        else:
            done.removed.append(p)
    done.latest = settle_pending_latest(root)
    return done


def settle_pending_latest(root: str | os.PathLike[str]) -> Path | None:
    """Move the pending `latest` that names the step discovery takes (`find_latest`: a committed step newer than
    `latest`'s) over `latest`, finishing that save's commit, and remove the other pending ones. Returns the step
    folder `latest` now names, or None when it did not move. A garbled or dangling `latest` is left as it is, and
    so are the pending files: loading says what is wrong with it."""
    root = Path(root)
    try:
        target = find_latest(root)
        current = read_latest(root)
    except CheckpointError:
        return None
    moved = None
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return None
    for p in entries:
        if not names.PENDING_LATEST_RE.match(p.name) or p.is_symlink() or not p.is_file():
            continue
        # A folder this user may not write (another's run, a read-only mount): discovery still follows the
        # pending pointer, so leaving it is no loss; the run's own save reports what it cannot write.
        try:
            text = p.read_text(encoding="utf-8", errors="replace").strip()
            if moved is None and target is not None and text == target.name and current != target.name:
                os.replace(p, root / names.LATEST)
                fsync_dir(root)
                moved = target
            else:
                p.unlink(missing_ok=True)
        except OSError:
            continue
    return moved


def undo_new_root(root: str | os.PathLike[str]) -> None:
    """Undo what a failed or interrupted save into a NEW checkpoints folder left (`ckpt convert`, `import-hf`):
    its interrupted save (as above: only folders of checkpoint files), then the folder itself if that empties it,
    so the same command can be run again. A Ctrl-C mid-convert left a checkpoint-sized `.tmp-` folder, and the
    rerun was refused: "destination already exists"."""
    root = Path(root)
    remove_interrupted_saves(root)
    try:
        if root.is_dir() and not any(root.iterdir()):
            root.rmdir()
    except OSError:
        pass
