"""Run a function on N local processes joined in a gloo process group: multi-rank tests on a CPU.

    from dist_helpers import run_distributed   # tests/ is on sys.path under pytest

    def _body(rank: int, world_size: int, root: str) -> int:   # module level: it is pickled by name
        ...                                                    # torch.distributed is initialised here
        return something_picklable

    @pytest.mark.slow
    def test_x(tmp_path):
        results = run_distributed(_body, world_size=2, root=str(tmp_path))   # [rank 0's, rank 1's]

Each child: `spawn` start method (no fork of pytest's state), `torch.set_num_threads(1)` (CI has 2 cores
for 2 ranks), RANK/WORLD_SIZE/LOCAL_RANK set, a gloo group over a `file://` rendezvous in a fresh temp
folder, collectives timing out after `timeout`. The parent fails the test (AssertionError) with the
child's own traceback if a child raises or dies; once one child has failed the others get
`FAIL_GRACE_S` to finish (they are usually stuck in a collective with the dead one) and are then
killed. A child still running after `timeout` seconds is killed and the test fails naming it as hung.
A spawn costs ~2-3 s (each child imports torch): put several checks in one body rather than many spawns.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as _mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FAIL_GRACE_S = 3.0


def run_distributed(fn: Callable[..., Any], world_size: int = 2, timeout: float = 120, **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, **kwargs)` on `world_size` gloo ranks; return their results in rank order."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="moectl-dist-") as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        results_q: _mp.Queue = ctx.Queue()
        procs = [
            ctx.Process(target=_child, args=(fn, rank, world_size, init, timeout, results_q, kwargs), daemon=True)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    rank, ok, payload = results_q.get(timeout=min(left, 0.2))
                except queue.Empty:
                    for rank, p in enumerate(procs):
                        if p.exitcode is not None and rank not in results and rank not in errors:
                            # Died without reporting (killed, os._exit, segfault). A report it queued
                            # just before exiting is already in the pipe, so this is not a race.
                            errors[rank] = (f"rank {rank} exited with code {p.exitcode} without a result"
                                            + (" (a signal: its Python stack is in the captured stderr)"
                                               if p.exitcode and p.exitcode < 0 else ""))
                    continue
                (results if ok else errors)[rank] = payload
                if errors:
                    deadline = min(deadline, time.monotonic() + FAIL_GRACE_S)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(10)
            results_q.close()
    hung = [r for r in range(world_size) if r not in results and r not in errors]
    if errors or hung:
        parts = [f"--- rank {r} failed ---\n{tb}" for r, tb in sorted(errors.items())]
        if hung:
            why = "after another rank failed" if errors else f"within timeout={timeout}s (hung?)"
            parts.append(f"--- rank(s) {hung} did not finish {why}; killed ---")
        raise AssertionError("distributed test failed\n" + "\n".join(parts))
    return [results[r] for r in range(world_size)]


def _child(
    fn: Callable[..., Any], rank: int, world_size: int, init: str, timeout: float, results_q: Any, kwargs: dict
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # A rank that dies in native code (one SIGSEGV in ~20 runs of test_pg_dist on the 2-core VM, tenth
    # session, not reproduced) prints every thread's Python stack to stderr, which pytest shows.
    faulthandler.enable()
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=init, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )  # fmt: skip
        out = fn(rank, world_size, **kwargs)
        results_q.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - the parent needs every failure's traceback
        results_q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
