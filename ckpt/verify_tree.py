"""Format 3 verification (`ckpt.digest`'s sha256 tree): hash every header and tensor of a checkpoint's files
in one pool, largest first, and judge each file from those hashes.

`ckpt.integrity` checks each file's structure and then calls these: the same per-tensor hashes give the
file's tree digest and name any tensor whose bytes changed, so every byte is read and hashed once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckpt import problems as P
from ckpt.digest import tree_digest
from ckpt.problems import Problem
from ckpt.shard_io import hash_ranges, io_threads
from ckpt.st_header import Header


def pieces(header: Header) -> list[tuple[int, int]]:
    """The byte ranges the tree digest hashes: the header, then every tensor, in file order."""
    return [(0, header.data_start)] + [(e.start, e.end) for e in sorted(header.entries.values(), key=lambda e: e.start)]


def hash_jobs(step_dir: Path, jobs: list[tuple[str, list[tuple[int, int]]]]
               ) -> tuple[dict[tuple[str, int, int], str], dict[str, Problem]]:  # fmt: skip
    """sha256 of every (file, ranges) job on the I/O threads, largest first: by (file, start, end), and a
    problem for each file that could not be read."""
    order = sorted(jobs, key=lambda j: j[1][0][0] - j[1][-1][1])  # longest span first: no long hash left last

    def run(job: tuple[str, list[tuple[int, int]]]) -> tuple[str, list[tuple[int, int]], list[str] | OSError]:
        fname, ranges = job
        try:
            return fname, ranges, hash_ranges(step_dir / fname, ranges)
        except OSError as e:
            return fname, ranges, e

    workers = max(1, min(len(order), io_threads()))
    if workers == 1:
        results = [run(j) for j in order]
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moectl-ckpt-verify") as pool:
            results = list(pool.map(run, order))
    hashed: dict[tuple[str, int, int], str] = {}
    failed: dict[str, Problem] = {}
    for fname, ranges, out in results:
        if isinstance(out, OSError):
            failed.setdefault(fname, P.unreadable(fname, out))
            continue
        for (start, end), sha in zip(ranges, out):
            hashed[(fname, start, end)] = sha
    return hashed, failed


def tree_problems(fname: str, header: Header, hashed: dict[tuple[str, int, int], str], frec: dict[str, Any],
                   expected: dict[str, Any]) -> list[Problem]:  # fmt: skip
    """A hashed format 3 file against its records: each tensor whose bytes changed, or the file's digest."""
    entries = sorted(header.entries.values(), key=lambda e: e.start)
    sha = {e.name: hashed[(fname, e.start, e.end)] for e in entries}
    changed = [t for t in sorted(set(expected) & set(sha)) if sha[t] != expected[t]["sha256"]]
    if changed:
        return [Problem(P.SHA256, fname, t, "bytes differ from the saved ones (sha256 mismatch)") for t in changed]
    if tree_digest(hashed[(fname, 0, header.data_start)], (sha[e.name] for e in entries)) != frec["sha256"]:
        return [Problem(P.SHA256, fname, None, "sha256 differs from the manifest although every tensor's bytes match: "
                                               "the file's header or the manifest was changed")]  # fmt: skip
    return []
