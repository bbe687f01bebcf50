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
