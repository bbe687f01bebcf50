"""Keep the torch profiler's own log lines out of a bench's output.

CPU builds of torch 2.13 have kineto write `USDT:... profiler_start` and `profiler_stop` lines to file
descriptor 2 each time a profiler starts and stops, between the bench's progress lines; no environment
variable silences them (`KINETO_LOG_LEVEL` does not). `without_profiler_chatter` sends fd 2 to a temporary
file while a profiled block runs and passes every other line on afterwards, so nothing else is lost.
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from typing import Iterator

CHATTER_PREFIX = "USDT:"


@contextmanager
def without_profiler_chatter() -> Iterator[None]:
    """Run the block with the profiler's `USDT:` lines dropped from stderr; other lines follow the block."""
    fd = 2  # kineto writes to the process's descriptor 2, whatever sys.stderr is (a capture, a wrapper)
    try:
        saved = os.dup(fd)
    except OSError:  # no descriptor 2 (a daemonised process): nothing to filter
        yield
        return
    sys.stderr.flush()
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(CHATTER_PREFIX)]  # fmt: skip
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
