"""Writing a command's `--json PATH` file: whole or not at all, and one error line when it cannot be written.

The option (`moectl.cli.options.JsonPathOpt`) checks the path and makes its folder before the command runs,
and asks the OS whether a file can be made there (`unwritable`); what can still fail is the write itself,
after minutes of work: a full disk (`--json /dev/full` stands for it), a quota, an I/O error. A plain
`write_text` then died with a traceback and left a truncated file that a script would read as the result.
Here the text goes to a temporary file in the same folder first and is renamed over PATH only once complete,
so PATH is either the old file, absent, or the whole new one.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Optional

from moectl.core.errors import MoectlError


class OutputError(MoectlError):
    """An output file that could not be written after the work ran (exit 1: a failure, not bad usage)."""


def write_json_file(path: Path, payload: Any, indent: int = 2) -> None:
    """Write `payload` as JSON to `path`, atomically for a regular file; raise `OutputError` naming the path and
    the reason if it cannot be written (no partial file is left behind)."""
    text = json.dumps(payload, indent=indent) + "\n"
    try:
        if _in_place(path):  # /dev/stdout, a FIFO: written in place (a rename would replace the node or link)
            with open(path, "w") as f:
                f.write(text)
            return
        # here, not at the top: the ckpt package imports torch, and `moectl --help` imports this module
        from ckpt.durable import fsync_dir, write_beside

        path = path.resolve()  # a link to a results file: the file it names is replaced, the link kept
        # the checkpoints' durable write: an fsynced sibling (0666 less the umask, as write_text gave), removed
        # if its write fails, then renamed over PATH
        tmp = write_beside(path, text.encode())
        try:
            os.replace(tmp, path)
        except BaseException:  # a failed rename, or Ctrl-C in the middle: nothing half-written stays
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
    except OSError as e:
        raise OutputError(f"cannot write --json {path}: {e.strerror or e}",
                          "free space there or give another path; the results above are complete") from None


def unwritable(path: Path) -> Optional[str]:
    """Why no file can be written at `path` now (None: one can), by the OS's answer: a file is made and removed in
    the folder the write will put its temporary file in. The permission bits say nothing for root, who still may
    not make files in /sys, /proc or a read-only mount; those passed a check of the bits, ran the whole command
    and failed at its end. A path written in place (a device, a FIFO, /dev/stdout) is left to the write: a probe
    would write into it."""
    if _in_place(path):
        return None
    folder = path.resolve().parent  # a link to a results file: the write replaces the file it names
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=folder)
    except OSError as e:
        return f"{folder} takes no new file ({e.strerror or e})"
    os.close(fd)
    os.unlink(probe)
    return None


def _in_place(path: Path) -> bool:
    """Whether `path` is written in place, not replaced: it exists and is not a regular file (a character
    device, a FIFO, a socket), or it is a link into /dev or /proc (`/dev/stdout` names `/proc/self/fd/1`, which
    may name a regular file the shell redirected to: replacing it would swap the system's link for a file)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return True
        return path.is_symlink() and str(path.resolve()).startswith(("/dev/", "/proc/"))
    except OSError:
        return False
