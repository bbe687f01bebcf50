"""The new folder a command writes its result into (`ckpt convert`, `export-hf`, `import-hf`): refused up front
when it exists or cannot be made, never after the work is done."""

from __future__ import annotations

import os
from pathlib import Path

from moectl.core.errors import CheckpointArgumentError


def new_destination(p: Path, fix: str = "give a new folder: nothing is ever overwritten") -> Path:
    """`p`, which must not exist yet and must be makeable: its nearest existing ancestor a writable folder. A path
    under a file ended an export in a traceback after the work was done, and a convert into a read-only folder
    ended in a save's error written for training runs."""
    p = p.expanduser()
    if p.exists() or p.is_symlink():
        raise CheckpointArgumentError(f"destination {p} already exists", fix)
    ancestor = next(a for a in p.absolute().parents if a.exists())
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        why = "is a file, not a folder" if not ancestor.is_dir() else "is not writable"
        raise CheckpointArgumentError(f"destination {p} cannot be made: {ancestor} {why}", "give a new folder")
    return p
