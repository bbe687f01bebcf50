"""Probe: where one rank's checkpoint write goes, part by part, on this machine's disk and cores.

A background save of the reference model on 2 H100s took 22 s per save against 4.2 s for a plain writer
(docs/benchmarks.md, issue 21; that writer wrote only the first 2 GiB of each file, see `write_all`).
This times, on a synthetic shard shaped like one rank's files (a few large fp32 tensors and many small
ones), each part `ckpt.shard_io.write_layout` overlaps: a whole-file sha256 in one sequential pass (what
formats 1-2 recorded, for comparison: format 3 no longer computes it), the per-tensor sha256s on the
thread pool (format 3's whole hashing), the in-order writes alone (writeback started per chunk), the
fsync; then `write_shard` as the save runs it, the two files of a rank as `save_checkpoint` writes them
(one after the other, then fsynced side by side), and a plain writer of the same bytes (sequential writes
and an fsync per file: the bench's floor). No assertion; a table.

Run: PYTHONPATH=. python3 scripts/probes/save_parts.py --dir /path/on/the/disk [--gb 6.4] [--threads N]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import time
from pathlib import Path

import torch

from ckpt.durable import fsync_files
from moectl.bench.ckpt_bench import write_all
from ckpt.shard_io import _run, _write_in_order, byte_view, io_threads
from ckpt.shards import prepare, write_shard
from ckpt.st_layout import layout


def shard(gb: float, seed: int) -> dict[str, torch.Tensor]:
    """About `gb` GB of fp32: four large flat tensors (masters and moments) and 200 small ones (norms, biases)."""
    g = torch.Generator().manual_seed(seed)
    big = int(gb * 1e9 / 4 / 4)
    out = {f"big.{i}": torch.empty(big).uniform_(generator=g) for i in range(4)}
    out.update({f"small.{i}": torch.randn(2048, generator=g) for i in range(200)})
    return out


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--gb", type=float, default=2.0, help="size of the large file (the small one is a sixth)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    threads = args.threads or io_threads()
    work = args.dir / "save_parts_probe"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tensors = prepare(shard(args.gb, 0), "optim")
    lay = layout(tensors, metadata={"format": "pt"})
    views = [memoryview(lay.header)] + [byte_view(p.tensor) for p in lay.placed]
    gb = lay.size / 1e9
    print(f"shard {gb:.2f} GB, {len(lay.placed)} tensors, {threads} threads, {os.cpu_count()} CPUs, dir {work}")
    rows: list[tuple[str, float]] = []

    def file_hash() -> None:
        h = hashlib.sha256()
        for v in views:
            h.update(v)

    rows.append(("whole-file sha256, one pass (format 1-2 only)", timed(file_hash)))
    jobs = [((p.name,), lambda v=byte_view(p.tensor): hashlib.sha256(v).hexdigest()) for p in lay.placed]
    rows.append(("tensor sha256s on the pool", timed(lambda: _run(jobs, threads))))

    def writes_only(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_in_order(fd, lay)
            t0 = time.perf_counter()
            os.fsync(fd)
            rows.append(("  of which fsync", time.perf_counter() - t0))
        finally:
            os.close(fd)

    rows.append(("in-order writes + fsync, no hashing", timed(lambda: writes_only(work / "w.bin"))))
    drop_cache(work / "w.bin")
    whole = timed(lambda: write_shard(work / "a.safetensors", tensors, threads))
    rows.append(("write_shard (all of it, as the save runs it)", whole))
    small = prepare(shard(args.gb / 6, 1), "model")

    def two_files() -> None:
        write_shard(work / "model.safetensors", small, threads, fsync=False)
        write_shard(work / "optim.safetensors", tensors, threads, fsync=False)
        fsync_files([work / "model.safetensors", work / "optim.safetensors"])

    rows.append(("a rank's two files, as the save writes them", timed(two_files)))
    blobs = {n: (work / n).read_bytes() for n in ("model.safetensors", "optim.safetensors")}

    def plain() -> None:
        for n, data in blobs.items():
            with open(work / f"plain-{n}", "wb", buffering=0) as f:
                write_all(f, memoryview(data))  # one write() stops at 2 GiB: loop, as the bench's floor does
                os.fsync(f.fileno())

    rows.append(("the same two files, plain writer (floor)", timed(plain)))
    for name, s in rows:
        size = gb * (1 + 1 / 6) if "two files" in name else gb
        rate = "" if name.startswith("  ") else f"{size / s:6.2f} GB/s"
        print(f"{name:48s} {s:8.3f} s  {rate}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
