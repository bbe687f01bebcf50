"""`moectl.bench.profiler_chatter`: the profiler's `USDT:` lines written to file descriptor 2 inside the block are
dropped, every other line reaches stderr after the block (also when the block raises)."""

from __future__ import annotations

import os

import pytest

from moectl.bench.profiler_chatter import without_profiler_chatter


def test_chatter_is_dropped_and_the_rest_kept(capfd: pytest.CaptureFixture[str]) -> None:
    with without_profiler_chatter():
        os.write(2, b"USDT:2026-11-27 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"warning: a real one\n")
        os.write(2, b"USDT:2026-11-27 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    err = capfd.readouterr().err
    assert "USDT" not in err and "warning: a real one\n" in err


def test_lines_written_before_a_raise_still_arrive(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError), without_profiler_chatter():
        os.write(2, b"the last words\n")
        raise RuntimeError("boom")
    assert "the last words" in capfd.readouterr().err
    os.write(2, b"after\n")
    assert "after" in capfd.readouterr().err  # fd 2 is back where it was


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_descriptor_is_left_open(capfd: pytest.CaptureFixture[str]) -> None:
    import time

    before = _fds()
    for _ in range(3):
        with without_profiler_chatter():
            os.write(2, b"x\n")
    time.sleep(0.2)  # the pass-on thread closes its two at the pipe's end
    assert _fds() == before


def test_a_process_killed_inside_the_block_has_shown_its_lines() -> None:
    """Lines go through as they arrive: a worker killed mid-step (torchrun's teardown) loses none."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, signal, time
        from moectl.bench.profiler_chatter import without_profiler_chatter
        with without_profiler_chatter():
            os.write(2, b"USDT:chatter\\nthe last words\\n")
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == -9 and "the last words" in r.stderr and "USDT" not in r.stderr
