"""Moving shard bytes between memory and disk at disk speed: parallel hashes, sequential writes, no copies.

Writing a file (`write_layout`): one thread writes the tensors' own memory where `ckpt.st_layout` placed
it, in file order, in chunks of `CHUNK` bytes gathered with `pwritev` (one system call per chunk however
many small tensors it spans, and no staging copy), starting each chunk's writeback as soon as it is written
(`ckpt.writeback`: the disk flushes while the rest is copied, instead of all of it in the final fsync);
meanwhile the other threads compute every tensor's sha256 from the same memory. One writer, not several:
Linux filesystems serialise buffered writes to one file under its inode lock, so more writer threads copy
no faster and only queue on the lock and reorder the file's writes. The file's digest is the sha256 tree of
`ckpt.digest` over the header's and the tensors' digests, so every byte is hashed once and no hash runs
over a whole file: the longest is the largest tensor's. `hashlib` and file writes release the GIL, so the
threads run in parallel on as many cores as `io_threads()` gives. (Until format 3 the file's own sha256
was a second, sequential pass over all its bytes: the long pole of a large save.)

Reading hashes back (`hash_file`, `hash_ranges`): one thread reads 8 MiB chunks into three reused buffers
while the caller's thread hashes the previous one, so the time is the slower of the disk and the hash, not
their sum; small neighbouring ranges (a file's many small tensors) are read with one call.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable

import torch

from ckpt.digest import tree_digest
from ckpt.st_layout import Layout
from ckpt.writeback import Writeback
from moectl.core.errors import UsageError

CHUNK = 32 << 20  # bytes per write call: large sequential I/O, and enough chunks to spread over the threads
READ_CHUNK = 8 << 20  # bytes per read: well past the kernel's readahead, yet 16 files verified at once hold
# only 16 x 3 x 8 MiB of buffers
_READ_BUFFERS = 3  # one being read, one being hashed, one spare so the reader never waits on a fast hash
_IOV_MAX = 1024  # Linux's limit on buffers per pwritev
ENV_THREADS = "MOECTL_CKPT_THREADS"


def io_threads() -> int:
    """Threads for a checkpoint's I/O and hashing: `MOECTL_CKPT_THREADS`, else this process's share of the
    CPUs it may use (divided among the ranks on the node, `LOCAL_WORLD_SIZE`, which save at the same time),
    at least 2 and at most 16: past that the disk, not the hashing, is the limit.

    A value that is not a positive integer is the user's to fix: a `UsageError` (one line, exit 2), not a
    bug's traceback."""
    env = os.environ.get(ENV_THREADS, "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise UsageError(f"environment variable {ENV_THREADS}={env!r} is not a positive integer",
                             f"set {ENV_THREADS} to the number of checkpoint I/O threads (e.g. 4), or unset it "
                             "for this process's share of the CPUs")  # fmt: skip
        return int(env)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    # At least 2: one thread's disk waits (writes, fsync, reads) then overlap another's hashing.
    return max(2, min(16, cpus // max(1, ranks_here)))


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying them (the tensor must outlive the view)."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def _sha256(views: list[memoryview]) -> str:
    h = hashlib.sha256()
    for v in views:
        h.update(v)  # releases the GIL for anything over 2 KiB
    return h.hexdigest()


def _write_ops(lay: Layout) -> list[tuple[int, list[memoryview]]]:
    """The file as (offset, buffers) chunks of about `CHUNK` bytes, in file order, over the tensors' memory."""
    ops: list[tuple[int, list[memoryview]]] = []
    bufs: list[memoryview] = []
    start = filled = 0

    def flush(next_start: int) -> None:
        nonlocal bufs, start, filled
        if bufs:
            ops.append((start, bufs))
        bufs, start, filled = [], next_start, 0

    pieces = [(0, memoryview(lay.header))] + [(p.start, byte_view(p.tensor)) for p in lay.placed]
    for offset, view in pieces:
        pos = 0
        while pos < len(view):
            take = min(len(view) - pos, CHUNK - filled)
            if not bufs:
                start = offset + pos
            bufs.append(view[pos : pos + take])
            filled += take
            pos += take
            if filled >= CHUNK or len(bufs) >= _IOV_MAX:
                flush(offset + pos)
    flush(lay.size)
    return ops


def _write_in_order(fd: int, lay: Layout) -> None:
    """Write the whole file front to back, starting each chunk's writeback once it is in the page cache."""
    writeback = Writeback(fd)
    for offset, bufs in _write_ops(lay):
        _pwritev_all(fd, offset, bufs)
        writeback.kick(offset, sum(len(b) for b in bufs))


def _pwritev_all(fd: int, offset: int, bufs: list[memoryview]) -> None:
    """Write every buffer at `offset` onwards, resuming after short writes."""
    while bufs:
        n = os.pwritev(fd, bufs, offset)
        if n <= 0:
            raise OSError(f"pwritev wrote {n} bytes")
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs = bufs[1:]
        if n:
            bufs = [bufs[0][n:], *bufs[1:]]


def write_layout(path: Path, lay: Layout, threads: int | None = None, fsync: bool = True
                 ) -> tuple[str, dict[str, str]]:  # fmt: skip
    """Write the new file `path` as `lay` places it (and fsync it unless `fsync` is False: the caller then
    must), and return (the file's tree digest, see `ckpt.digest`; each tensor's sha256).

    Refuses to overwrite (`O_EXCL`: a nonce clash is a bug). On any error the partial file is left for the
    caller's cleanup (the save removes its whole in-flight folder) and the first error is raised once every
    thread has stopped touching the file and the tensors.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        # The writer first, so the disk is busy from the start; then the hashes, largest first, so no large
        # hash is left to run alone at the end. The writer has a thread of its own beside the hashers.
        jobs: list[tuple[object, Callable[[], object]]] = [(None, lambda: _write_in_order(fd, lay))]
        jobs += [(p.name, lambda v=byte_view(p.tensor): _sha256([v]))
                 for p in sorted(lay.placed, key=lambda p: p.start - p.end)]  # fmt: skip
        results = _run(jobs, (threads or io_threads()) + 1)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    tensor_sha = {p.name: str(results[p.name]) for p in lay.placed}
    header_sha = hashlib.sha256(lay.header).hexdigest()
    return tree_digest(header_sha, (tensor_sha[p.name] for p in lay.placed)), tensor_sha


def _run(jobs: list[tuple[object, Callable[[], object]]], threads: int) -> dict[object, object]:
    """Run `jobs` on `threads` threads (the first job starts first); the results of those with a key (not
    None), or the first error."""
    if threads <= 1 or len(jobs) <= 1:
        results: dict[object, object] = {}
        for key, fn in jobs:
            out = fn()
            if key is not None:
                results[key] = out
        return results
    with ThreadPoolExecutor(max_workers=min(threads, len(jobs)), thread_name_prefix="moectl-ckpt-io") as pool:
        futures: list[tuple[object, Future]] = [(key, pool.submit(fn)) for key, fn in jobs]
        done, _ = wait([f for _, f in futures], return_when=FIRST_EXCEPTION)
        failed = next((f for f in done if f.exception() is not None), None)
        if failed is not None:
            for _, f in futures:
                f.cancel()
            wait([f for _, f in futures])  # nothing may still write through the fd or read the tensors
            raise failed.exception()  # type: ignore[misc]
        return {key: f.result() for key, f in futures if key is not None}


def hash_file(path: Path, start: int = 0, end: int | None = None) -> str:
    """sha256 of bytes [start, end) of `path` (to the end by default): reads overlap hashing (see module doc)."""
    h = hashlib.sha256()
    size = os.stat(path).st_size
    stop_at = size if end is None else min(end, size)
    if stop_at - start <= READ_CHUNK:  # one read: no thread to overlap it with
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            h.update(f.read(max(0, stop_at - start)) if end is not None else f.read())
        return h.hexdigest()
    free: queue.Queue = queue.Queue()
    full: queue.Queue = queue.Queue()
    for _ in range(_READ_BUFFERS):
        free.put(bytearray(READ_CHUNK))
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            with open(path, "rb", buffering=0) as f:
                f.seek(start)
                left = None if end is None else end - start
                while not stop.is_set() and left != 0:
                    buf = free.get()
                    want = READ_CHUNK if left is None else min(READ_CHUNK, left)
                    n = f.readinto(memoryview(buf)[:want])
                    if not n:
                        free.put(buf)
                        break
                    full.put((buf, n))
                    if left is not None:
                        left -= n
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)
        finally:
            full.put(None)

    t = threading.Thread(target=reader, name="moectl-ckpt-read", daemon=True)
    t.start()
    try:
        while (item := full.get()) is not None:
            buf, n = item
            h.update(memoryview(buf)[:n])
            free.put(buf)
    finally:
        stop.set()
        free.put(bytearray(0))  # wake a reader blocked on an empty pool (it then sees stop)
        t.join()
    if errors:
        raise errors[0]
    return h.hexdigest()


def hash_ranges(path: Path, ranges: list[tuple[int, int]]) -> list[str]:
    """sha256 of each byte range [start, end) of `path`, in order. Ranges that together span at most
    `READ_CHUNK` bytes are read with one call and hashed from memory (a file's small tensors), a larger one
    by `hash_file`'s overlapped reads. Callers group ranges by neighbourhood (`range_jobs`)."""
    if not ranges:
        return []
    lo, hi = min(s for s, _ in ranges), max(e for _, e in ranges)
    if len(ranges) == 1 and hi - lo > READ_CHUNK:
        return [hash_file(path, lo, hi)]
    with open(path, "rb", buffering=0) as f:
        f.seek(lo)
        data = f.read(hi - lo)
    view = memoryview(data)
    return [hashlib.sha256(view[s - lo : e - lo]).hexdigest() for s, e in ranges]


def range_jobs(ranges: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`ranges` (sorted by start) in groups for `hash_ranges`: neighbours spanning at most `READ_CHUNK`
    bytes together, and every larger range alone."""
    groups: list[list[tuple[int, int]]] = []
    for r in ranges:
        if groups and r[1] - groups[-1][0][0] <= READ_CHUNK:  # the group, with r, still fits one read
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups
