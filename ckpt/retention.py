"""Retention: keep the newest `keep_last` committed steps, delete older committed ones, nothing else.

Only committed folders are candidates (an interrupted `.tmp-` save, a manifest-less folder or anything
else is never touched), and the step `latest` names is never deleted even if it is not among the newest
(e.g. after a rollback). A folder is first renamed to `step_N.trash-<nonce>`, which discovery ignores,
then removed: a crash half-way through a delete leaves an ignored trash folder, never a committed-looking
step with missing files. Only rank 0 calls this (torchtitan tests that other ranks never purge).
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from ckpt import names
from ckpt.discovery import list_committed
from ckpt.durable import fsync_dir


def apply_retention(root: str | os.PathLike[str], keep_last: int | None) -> list[Path]:
    """Delete committed steps under `root` older than the newest `keep_last`; returns the deleted folders."""
    if keep_last is None:
        return []
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
    root = Path(root)
    committed = list_committed(root)
    try:
        protected = (root / names.LATEST).read_text(encoding="utf-8").strip()
    except OSError:
        protected = None
    doomed = [p for p in committed[:-keep_last] if p.name != protected]
    for p in doomed:
        remove_step_dir(p)
    return doomed


def remove_step_dir(path: Path) -> None:
    """Delete one committed step folder: rename it out of discovery's sight first, then remove it."""
    step = names.parse_step_dir(path.name)
    if step is None:
        raise ValueError(f"refusing to delete {path}: not a step_NNNNNNNN folder")
    trash = path.with_name(names.trash_dir_name(step, secrets.token_hex(4)))
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash)
