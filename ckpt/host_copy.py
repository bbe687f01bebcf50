"""A synchronous save's copy of device tensors to the host: one page-locked buffer, not one pageable copy each.

`ckpt.shards.prepare` moves each tensor to the CPU with `.to("cpu")`: on CUDA that is a pageable copy per
tensor into freshly allocated memory, which the driver stages through its own pinned buffers while the new
pages are faulted in, on one thread, one tensor after another. On 2 H100s the synchronous save of a 12.8 GB
share took 38.8 s where the first background save, the same writer after a copy into one registered buffer,
took 24.7 s in all, allocation included (docs/benchmarks.md). `on_host` gives the synchronous save that same
copy: `ckpt.staging.HostStaging` for the duration of the save, then freed. Host tensors pass through as
they are. Where host memory is short for the whole share at once (`MemAvailable` against its size times the
ranks on the node, plus `HEADROOM`), the tensors pass through too and `prepare` copies them file by file,
as before.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from ckpt.staging import Files, HostStaging, _on_device, host_memory_available, staged_size

HEADROOM = 2 << 30  # memory left to the rest of the process and the page cache (as for background saves)


def memory_shortfall(nbytes: int) -> str:
    """Why `nbytes` more host memory per rank on this node cannot be held on top of what is in use ('' when it
    can, or when the available memory is unknown). The one rule of synchronous and background saves."""
    free = host_memory_available() if nbytes else None
    if free is None:
        return ""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if nbytes * ranks_here + HEADROOM <= free:
        return ""
    return (f"the host copy needs {nbytes / 2**30:.1f} GiB x {ranks_here} rank(s) on this node and "
            f"{free / 2**30:.1f} GiB is available")


def fits_in_memory(nbytes: int) -> bool:
    """Whether `nbytes` per rank on this node can be held on top of what is in use (True where unknown)."""
    return not memory_shortfall(nbytes)


@contextmanager
def on_host(files: Files) -> Iterator[Files]:
    """`files` with every tensor in host memory for the length of the block: device tensors copied into one
    page-locked buffer (freed on exit; nothing may use the tensors after it), host tensors as they are."""
    if not _on_device(files) or not fits_in_memory(staged_size(files)):
        yield files
        return
    staging = HostStaging()
    try:
        staged = staging.stage(files)
    except (RuntimeError, OSError, MemoryError):
        # Pinning refused or memory gone meanwhile: the per-file copies still work, and a failure here would
        # come before the save's vote, leaving the other ranks waiting in it.
        staging.release()
        yield files
        return
    try:
        yield staged
    finally:
        del staged
        staging.release()
