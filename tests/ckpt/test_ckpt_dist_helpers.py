"""The spawn helper itself: a child's exception and a hung child fail the test, without waiting forever; a
rank's native crash runs the spawn once more, with a warning that carries the rank's stderr.

(Results in rank order and one thread per child are checked by test_ckpt_multirank.py, which saves a spawn.)
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist
from dist_helpers import NativeCrashWarning, run_distributed


def _rank1_raises_then_rank0_waits(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # never completes normally: rank 1 is gone


def _hangs(rank: int, world_size: int) -> None:
    time.sleep(600)


def _rank1_aborts(rank: int, world_size: int, marker: str, every_time: bool, then: str = "return") -> int:
    """Rank 1 dies of SIGABRT (as glibc does on a corrupted heap): on the first spawn only, or every time. Then the
    ranks return, or meet in a barrier (where rank 0 alone meets gloo's "Connection reset by peer" if rank 1 died),
    or rank 0 fails on its own."""
    print(f"rank {rank} says hello", file=sys.stderr, flush=True)
    # Both ranks finish connecting first: a rank that returned at once could close its side while the other was
    # still in gloo's connectFullMesh ("Connection closed by peer" in init_process_group, once in a full run).
    dist.barrier()
    if rank == 1 and (every_time or not os.path.exists(marker)):
        Path(marker).touch()
        os.abort()
    if then == "barrier":
        dist.barrier()
    if rank == 0 and then == "raise":
        raise ValueError("rank 0's own failure")
    return rank


@pytest.mark.slow
def test_a_child_exception_fails_the_test_with_its_traceback() -> None:
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as seen, pytest.raises(AssertionError) as err:
        warnings.simplefilter("always")
        run_distributed(_rank1_raises_then_rank0_waits, world_size=2, timeout=60)
    assert not [w for w in seen if issubclass(w.category, NativeCrashWarning)]  # an exception is not retried
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


@pytest.mark.slow
def test_a_native_crash_runs_the_spawn_again_and_warns_with_the_ranks_stderr(tmp_path: Path, capfd) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert run_distributed(_rank1_aborts, world_size=2, timeout=60, marker=str(tmp_path / "m"),
                               every_time=False) == [0, 1]  # fmt: skip
    crashes = [w for w in seen if issubclass(w.category, NativeCrashWarning)]
    assert len(crashes) == 1
    text = str(crashes[0].message)
    assert "rank 1 died of SIGABRT" in text and "rank 1 says hello" in text and "Fatal Python error" in text
    err = capfd.readouterr().err  # every child's stderr, replayed by the parent
    assert "--- rank 0 stderr ---" in err and "rank 0 says hello" in err


@pytest.mark.slow
def test_a_native_crash_in_the_second_spawn_fails_the_test(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as seen, pytest.raises(AssertionError) as err:
        warnings.simplefilter("always")
        run_distributed(_rank1_aborts, world_size=2, timeout=60, marker=str(tmp_path / "m"), every_time=True)
    assert "rank 1 exited with code -6 without a result" in str(err.value)
    assert sum(issubclass(w.category, NativeCrashWarning) for w in seen) == 1  # one retry, no more



@pytest.mark.slow
def test_a_crash_whose_peer_lost_it_in_a_collective_is_retried(tmp_path: Path) -> None:
    """The CI case: rank 1 aborts, rank 0 fails in gloo with the lost peer (or hangs and is killed)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = run_distributed(_rank1_aborts, world_size=2, timeout=60, marker=str(tmp_path / "m"), every_time=False,
                              then="barrier")  # fmt: skip
    assert out == [0, 1] and sum(issubclass(w.category, NativeCrashWarning) for w in seen) == 1


@pytest.mark.slow
def test_a_crash_beside_another_ranks_own_failure_is_not_retried(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as seen, pytest.raises(AssertionError) as err:
        warnings.simplefilter("always")
        run_distributed(_rank1_aborts, world_size=2, timeout=60, marker=str(tmp_path / "m"), every_time=False,
                        then="raise")  # fmt: skip
    assert "ValueError: rank 0's own failure" in str(err.value)
    assert not [w for w in seen if issubclass(w.category, NativeCrashWarning)]
