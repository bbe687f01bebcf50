"""Durable writes: data reaches the disk before anything points at it.

A rename is only a commit if the renamed bytes and the directory entry are on disk first, so every file
is fsynced before it is renamed or referenced, and the parent folder is fsynced after an entry in it
changes. (PyTorch DCP fsyncs `.metadata.tmp` before renaming it to `.metadata`; Megatron writes its
tracker file only after the save has finished. We follow both, and also fsync folders, which neither does.)
"""

from __future__ import annotations

import errno
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def write_file(path: Path, data: bytes | memoryview) -> None:
    """Write `data` to a new file at `path` and fsync it. Refuses to overwrite (a nonce clash is a bug)."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_files(paths: list[Path]) -> None:
    """fsync every file of `paths`, side by side (each waits for the disk; the flushes overlap)."""

    def one(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    if len(paths) <= 1:
        for p in paths:
            one(p)
        return
    with ThreadPoolExecutor(max_workers=len(paths), thread_name_prefix="moectl-ckpt-fsync") as pool:
        list(pool.map(one, paths))  # re-raises the first error


def fsync_dir(path: Path) -> None:
    """Make the entries of folder `path` (new files, renames) durable.

    Some network filesystems refuse fsync on a folder (EINVAL/ENOTSUP); there the rename is already as
    durable as that filesystem can make it, so those two errors are ignored and every other one raised.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def write_beside(path: Path, data: bytes) -> Path:
    """Write `data` to a new fsynced sibling of `path`, `<name>.tmp-<nonce>`, and return it; the caller moves it
    over `path` (`os.replace`, then `fsync_dir` of the folder) when it is time: a reader sees the old content or
    the new, never a torn mix, and the new content is on disk before anything that must precede the move."""
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        write_file(tmp, data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp
