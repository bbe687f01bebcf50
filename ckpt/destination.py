"""The new folder a command writes its result into (`ckpt convert`, `export-hf`, `import-hf`): refused up front
when it exists or cannot be made, never after the work is done; a write that fails later (a full disk) is
one line naming the destination and the OS's reason (`write_failure`)."""

from __future__ import annotations

import errno
import os
import re
import shlex
import tempfile
from pathlib import Path
from typing import Optional

from ckpt import names
from ckpt.cleanup import only_interrupted_saves
from ckpt.save import CheckpointSaveError
from moectl.core.errors import CheckpointArgumentError, CheckpointError


def new_destination(p: Path, fix: str = "give a new folder: nothing is ever overwritten",
                    source: Optional[Path] = None) -> Path:
    """`p`, which must not exist yet and must be makeable: its nearest existing ancestor a writable folder. A path
    under a file ended an export in a traceback after the work was done, and a convert into a read-only folder
    ended in a save's error written for training runs.

    `source`: the step folder the command reads. `p` may not be inside it (an export there made the source
    fail its own verification: a folder its manifest does not list), nor inside the checkpoints folder that
    holds it (one with a `latest`): a convert written there as `step_NNNNNNNN` later stopped the run that saves
    into that folder, at that step."""
    p = p.expanduser()
    if p.exists() or p.is_symlink():
        left = only_interrupted_saves(p) if p.is_dir() and not p.is_symlink() else []
        if left:  # SIGKILL (the OOM killer, a scheduler) gives the command no chance to remove its unfinished save
            raise CheckpointArgumentError(
                f"destination {p} already exists, holding only {left[0]}{' and more' if len(left) > 1 else ''}: the "
                "unfinished save of a command that was killed or is still running (nothing in it was committed)",
                f"if no moectl command is writing there, delete it (rm -r -- {shlex.quote(str(p))}) and run the command "
                "again; or give a new folder")
        raise CheckpointArgumentError(f"destination {p} already exists", fix)
    if source is not None:
        _outside(p, source.expanduser())
    ancestor = next(a for a in p.absolute().parents if a.exists())
    if not ancestor.is_dir():
        raise CheckpointArgumentError(f"destination {p} cannot be made: {ancestor} is a file, not a folder",
                                      "give a new folder")
    try:  # the OS's answer, not the permission bits: root may not write into /sys or a read-only mount either
        os.rmdir(tempfile.mkdtemp(prefix=".moectl-probe-", dir=ancestor))
    except OSError as e:
        raise CheckpointArgumentError(f"destination {p} cannot be made: {ancestor} is not writable "
                                      f"({e.strerror or e})", "give a new folder you may write to") from None
    return p


#: the OS's refusals of a write that only the destination's disk explains (a read of the source failing with
#: EIO, say, is the source's problem and keeps its own error)
DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def raise_write_failure(what: str, dst: Path, e: BaseException) -> None:
    """Raise one line for a tool's write into `dst` that its disk refused after the checks (full, over quota,
    read-only): what, where, the OS's reason. Returns for any other failure (the caller re-raises it). The
    caller has removed what it wrote. A one-process save (`save_checkpoint`) reports rank 0's error as text, an
    OS one with its errno; safetensors wraps the OS's error code and message in its own error."""
    if isinstance(e, CheckpointSaveError):
        reason = e.failures.get(0, "")
        code = re.search(r"\[Errno (\d+)\]", reason)
        if e.committed or code is None or int(code.group(1)) not in DISK_FULL:
            return
    elif isinstance(e, OSError):
        if e.errno not in DISK_FULL:
            return
        reason = e.strerror or str(e)
    elif type(e).__name__ == "SafetensorError":
        code = re.search(r"code: (\d+)", str(e))
        if code is None or int(code.group(1)) not in DISK_FULL:
            return
        reason = _safetensors_reason(str(e))
    else:
        return
    fix = "make room on that disk or give a destination on another one; nothing was left behind"
    raise CheckpointError(f"writing {what} {dst} failed: {reason}", fix) from None


def _safetensors_reason(text: str) -> str:
    """The OS message inside a safetensors error (`... Os { code: 28, ..., message: "No space left on device" }`)."""
    found = re.search(r'message: "([^"]+)"', text)
    return found.group(1) if found else text


def _outside(p: Path, source: Path) -> None:
    """Refuse `p` inside the step folder `source` or inside the checkpoints folder holding it."""
    target = p.absolute().resolve()
    step = source.absolute().resolve()
    root = step.parent
    if step in target.parents:
        where = f"inside the source checkpoint {source}"
    elif (root / names.LATEST).exists() and root in target.parents:
        where = f"inside {root}, the checkpoints folder of the source (a run saving there would meet it)"
    else:
        return
    raise CheckpointArgumentError(f"destination {p} is {where}", "write it somewhere outside the source's folder")
