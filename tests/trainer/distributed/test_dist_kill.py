"""A rank killed mid-run makes the survivor fail within the collective timeout instead of hanging.

`tests/dist_helpers.run_distributed` fails a test when any child dies, which is the event under test
here, so this file starts its two ranks itself. They join the way torchrun starts them: RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment and `init_distributed` (env://
rendezvous, gloo) with a 15 s collective timeout. Rank 1 SIGKILLs itself after a backward, before the
grad reduce; rank 0 must come back from `finish_grad_sync` with an error, well within the timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from typing import Any

import pytest

pytestmark = pytest.mark.slow

PG_TIMEOUT_S = 15.0
KILL_AT_STEP = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        import torch

        torch.set_num_threads(1)
        from dist_toy import Run, forward_backward, make
        from moectl.core.config.schema import ParallelConfig
        from trainer.parallel.groups import init_distributed

        st = init_distributed(ParallelConfig(overlap_grad_reduce=True), timeout_s=PG_TIMEOUT_S)
        run = Run(steps=5)
        _, dm, opt = make(st, ParallelConfig(overlap_grad_reduce=True, bucket_size=100), run)
        for step in range(run.steps):
            dm.zero_grad_buffer()
            forward_backward(dm, st, run, step)
            if step == KILL_AT_STEP and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.monotonic()
            try:
                dm.finish_grad_sync()
                opt.step(run.lr)
            except Exception as e:  # noqa: BLE001 - the survivor's error is the result
                results.put((rank, "error", step, time.monotonic() - t0, f"{type(e).__name__}: {e}"[:300]))
                break
        else:
            results.put((rank, "finished", run.steps, 0.0, ""))
    except BaseException:  # noqa: BLE001
        results.put((rank, "crash", -1, 0.0, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # flush the report before the hard exit below
        os._exit(0)  # never linger in process-group teardown with a dead peer


def test_a_killed_rank_makes_the_survivor_fail_instead_of_hanging() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 90
    got: dict[int, tuple] = {}
    try:
        while 0 not in got and time.monotonic() < deadline:
            try:
                item = results.get(timeout=0.5)
                got[item[0]] = item
            except queue.Empty:
                if procs[0].exitcode is not None and 0 not in got:
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()) if p is procs[0] else 5)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert 0 in got, f"rank 0 did not report within the deadline (hung?): {got}"
    rank, kind, step, waited, message = got[0]
    assert kind == "error", got[0]
    assert step == KILL_AT_STEP
    assert waited < PG_TIMEOUT_S + 5, f"rank 0 needed {waited:.1f}s to notice"
    assert procs[1].exitcode == -signal.SIGKILL
    assert 1 not in got  # the victim never reported: it really died mid-step
