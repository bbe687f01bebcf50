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

Native crashes. Each child writes its stderr to a file the parent replays into its own stderr (pytest
shows it with a failure, as before); on a fatal signal faulthandler prints every thread's Python stack
there (DIST_HELPERS_NATIVE_STACKS=1 adds every thread's C++ stack from c10's handler). A spawn in which
a rank died of a signal the parent did not send (a segfault, glibc aborting on a corrupted heap) runs
once more, and a `NativeCrashWarning` with that rank's last stderr lines goes to pytest's warnings
summary. Only then: a spawn in which another rank raised anything but gloo's lost-peer error fails at
once, and a rank that crashed after reporting its result lost nothing. The rerun gets the same
arguments: a body that writes under a path it is given must tolerate what the first run left there. A
crash in the second run fails the test; Python exceptions and hangs are never retried.

Why: twice a gloo child of the param-gather tests died so (tenth session: SIGSEGV; CI of the
twenty-fourth: "malloc(): unaligned tcache chunk detected" while its main thread waited on a gloo
all-gather, its peer then failing with "Connection reset by peer"), and neither was reproduced
(twenty-fifth session: 22 pytest runs of the crashed test and 620 runs of its body, 290 of them under
glibc's malloc checks, 2-3 spawns at once on 2 cores).
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as _mp
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FAIL_GRACE_S = 3.0


#: How many more times a spawn runs after a rank died of a signal the parent did not send.
NATIVE_CRASH_RETRIES = 1
#: How much of a crashed rank's stderr the warning carries (the C++ and Python stacks).
CRASH_TAIL_LINES = 80


class NativeCrashWarning(UserWarning):
    """A rank died of a signal (a native crash) and the spawn was run again."""


@dataclass
class _Outcome:
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    crashed: dict[int, str] = field(default_factory=dict)  # rank -> signal name, signals the parent did not send
    stderr: dict[int, str] = field(default_factory=dict)


def run_distributed(fn: Callable[..., Any], world_size: int = 2, timeout: float = 120, **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, **kwargs)` on `world_size` gloo ranks; return their results in rank order."""
    for attempt in range(NATIVE_CRASH_RETRIES + 1):
        out = _spawn_once(fn, world_size, timeout, kwargs)
        if attempt < NATIVE_CRASH_RETRIES and _only_a_native_crash(out):
            rank, sig = next(iter(out.crashed.items()))
            tail = "\n".join(out.stderr.get(rank, "").splitlines()[-CRASH_TAIL_LINES:])
            others = "".join(f"\n--- rank {r} (lost its peer) ---\n{tb}" for r, tb in sorted(out.errors.items())
                             if r not in out.crashed)  # fmt: skip
            warnings.warn(NativeCrashWarning(
                f"{getattr(fn, '__qualname__', fn)}: rank {rank} died of {sig} (a native crash); the spawn runs "
                f"again. The rank's stderr ended:\n{tail}{others}"), stacklevel=2)
            continue
        break
    hung = [r for r in range(world_size) if r not in out.results and r not in out.errors]
    if out.errors or hung:
        parts = [f"--- rank {r} failed ---\n{tb}" for r, tb in sorted(out.errors.items())]
        if hung:
            why = "after another rank failed" if out.errors else f"within timeout={timeout}s (hung?)"
            parts.append(f"--- rank(s) {hung} did not finish {why}; killed ---")
        raise AssertionError("distributed test failed\n" + "\n".join(parts))
    return [out.results[r] for r in range(world_size)]


#: what gloo says on a rank whose peer died under it (tcp/pair.cc): the crash's echo, not a failure of its own
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _only_a_native_crash(out: _Outcome) -> bool:
    """Whether the spawn failed only because a rank died of a signal: every other failed rank raised nothing but
    gloo's lost-peer error, or hung waiting on it. A rank's own exception is never retried away."""
    if not out.crashed:
        return False
    return all(r in out.crashed or any(s in tb for s in PEER_LOST) for r, tb in out.errors.items())


def _spawn_once(fn: Callable[..., Any], world_size: int, timeout: float, kwargs: dict) -> _Outcome:
    ctx = mp.get_context("spawn")
    out = _Outcome()
    with tempfile.TemporaryDirectory(prefix="moectl-dist-") as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        logs = [os.path.join(tmp, f"rank{rank}.stderr") for rank in range(world_size)]
        results_q: _mp.Queue = ctx.Queue()
        procs = [
            ctx.Process(target=_child, args=(fn, rank, world_size, init, timeout, results_q, kwargs, logs[rank]),
                        daemon=True)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        killed: set[int] = set()
        deadline = time.monotonic() + timeout
        try:
            while len(out.results) + len(out.errors) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    rank, ok, payload = results_q.get(timeout=min(left, 0.2))
                except queue.Empty:
                    for rank, p in enumerate(procs):
                        if p.exitcode is not None and rank not in out.results and rank not in out.errors:
                            # Died without reporting (killed, os._exit, segfault). A report it queued
                            # just before exiting is already in the pipe, so this is not a race.
                            out.errors[rank] = (f"rank {rank} exited with code {p.exitcode} without a result"
                                                + (" (a signal: its Python stack is in the captured stderr)"
                                                   if p.exitcode and p.exitcode < 0 else ""))
                    continue
                (out.results if ok else out.errors)[rank] = payload
                if out.errors:
                    deadline = min(deadline, time.monotonic() + FAIL_GRACE_S)
        finally:
            for rank, p in enumerate(procs):
                if p.is_alive():
                    killed.add(rank)
                    p.kill()
            for p in procs:
                p.join(10)
            results_q.close()
        for rank, p in enumerate(procs):  # a rank that reported its result and then crashed lost nothing
            if p.exitcode is not None and p.exitcode < 0 and rank not in killed and rank not in out.results:
                out.crashed[rank] = _signal_name(-p.exitcode)
        for rank, path in enumerate(logs):
            try:
                with open(path, errors="replace") as f:
                    out.stderr[rank] = f.read()
            except FileNotFoundError:  # the child died before opening it
                continue
            if out.stderr[rank]:
                sys.stderr.write(f"--- rank {rank} stderr ---\n{out.stderr[rank]}")
    return out


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _child(
    fn: Callable[..., Any], rank: int, world_size: int, init: str, timeout: float, results_q: Any, kwargs: dict,
    log: str,
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    sys.stderr.flush()
    stderr = open(log, "w")  # noqa: SIM115 - fd 2 points at it for the life of the process
    os.dup2(stderr.fileno(), 2)
    # A rank that dies in native code prints every thread's Python stack (faulthandler: async-signal-safe)
    # into its stderr file, which the parent replays. DIST_HELPERS_NATIVE_STACKS=1 adds every thread's C++
    # stack (c10's handler, which then hands the signal on); off by default because it symbolises with
    # malloc inside the handler, which can hang a process that died of a corrupted heap.
    faulthandler.enable()
    native = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
    if os.environ.get("DIST_HELPERS_NATIVE_STACKS") == "1" and native is not None:
        native(True)
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
