"""The spawn helper itself: a child's exception and a hung child fail the test, without waiting forever.

(Results in rank order and one thread per child are checked by test_ckpt_multirank.py, which saves a spawn.)
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
from dist_helpers import run_distributed


def _rank1_raises_then_rank0_waits(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # never completes normally: rank 1 is gone


def _hangs(rank: int, world_size: int) -> None:
    time.sleep(600)


@pytest.mark.slow
def test_a_child_exception_fails_the_test_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as err:
        run_distributed(_rank1_raises_then_rank0_waits, world_size=2, timeout=60)
    text = str(err.value)
    assert "--- rank 1 failed ---" in text and "ValueError: boom from rank 1" in text
    # Rank 0 either sees gloo drop the connection and fails too, or is killed after the grace period.
    assert "--- rank 0 failed ---" in text or "rank(s) [0] did not finish after another rank failed" in text
    assert time.monotonic() - start < 30  # the grace period, not the 60 s timeout


@pytest.mark.slow
def test_hung_child_is_killed_at_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank\(s\) \[0, 1\] did not finish within timeout=3s \(hung\?\)"):
        run_distributed(_hangs, world_size=2, timeout=3)  # hung whether or not they started
    assert time.monotonic() - start < 20
