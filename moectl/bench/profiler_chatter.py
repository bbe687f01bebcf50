"""Keep the torch profiler's own log lines out of a bench's output.

CPU builds of torch 2.13 have kineto write `USDT:... profiler_start` and `profiler_stop` lines to file
descriptor 2 each time a profiler starts and stops, between the bench's progress lines; no environment
variable silences them (`KINETO_LOG_LEVEL` does not). `without_profiler_chatter` points fd 2 at a pipe while a
profiled block runs; a thread passes every other line on to the real stderr as it arrives, so nothing is held
back (a process killed inside the block has already shown what it wrote) and a child that outlives the block
still reaches stderr.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

CHATTER_PREFIX = b"USDT:"


def _pass_on(pipe_fd: int, out_fd: int) -> None:
    """Copy the pipe's lines to `out_fd`, but the profiler's; close both at the pipe's end (the last writer gone)."""
    with os.fdopen(pipe_fd, "rb") as pipe, os.fdopen(out_fd, "wb", buffering=0) as out:
        for line in pipe:
            if not line.startswith(CHATTER_PREFIX):
                out.write(line)


@contextmanager
def without_profiler_chatter() -> Iterator[None]:
    """Run the block with the profiler's `USDT:` lines dropped from fd 2; every other line goes through."""
    fd = 2  # kineto writes to the process's descriptor 2, whatever sys.stderr is (a capture, a wrapper)
    opened: list[int] = []
    try:
        read_end, write_end = os.pipe()
        opened += [read_end, write_end]
        saved = os.dup(fd)
        opened.append(saved)
        out = os.dup(saved)  # the thread's own: it may outlive the block while a child holds the pipe
        opened.append(out)
    except OSError:  # no descriptor 2, or none left: run unfiltered
        for d in opened:
            os.close(d)
        yield
        return
    sys.stderr.flush()
    os.dup2(write_end, fd)
    os.close(write_end)
    reader = threading.Thread(target=_pass_on, args=(read_end, out), name="moectl-stderr-filter", daemon=True)
    reader.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, fd)  # this process's last writer to the pipe goes: the thread reads to its end
        os.close(saved)
        reader.join(timeout=5)  # a child still writing keeps it going, on its own
