"""Fault injection for save tests: `MOECTL_CKPT_FAIL=<rank>:<phase>[:<how>][@<step>]` (comma-separate several).

Phases, in the order a save reaches them (PyTorch DCP's `FaultyStorageWriter` injects at the same
points of its own protocol):
  write            on that rank, right after its first shard file is written ("crash after some files")
  finalize         on that rank, after all its files and their folder entries are fsynced, before the vote
  before_manifest  rank 0 only: after every rank voted ok, just before manifest.json (the commit marker)
  before_latest    rank 0 only: after the folder was renamed to step_N (committed), before `latest` moves
How:
  raise  (default) an ordinary exception: the save fails on every rank, cleanly, naming that rank
  enospc an `OSError` ENOSPC, as a full disk raises it (the save fails as with `raise`)
  eacces a `PermissionError` EACCES, as a folder the process may not write raises it
  crash  an uncatchable `InjectedCrash` (BaseException) that skips all cleanup and collectives, leaving
         what a killed process leaves. Use it in single-process tests only: in a multi-rank run the
         other ranks would wait for the dead one until the process group times out, as with a real kill.
  stall  the thread stops there for good (sleeps), so a test can kill the process in the middle of a save
  slow   the thread sleeps `SLOW_S` (1) seconds there, then goes on (a slow disk: what waits for the save?)
`@<step>`: only the save of that step (default: every save).
The variable is read at every check, so a test can set it in a child process.
"""

from __future__ import annotations

import errno
import os
import time

ENV = "MOECTL_CKPT_FAIL"
PHASES = ("write", "finalize", "before_manifest", "before_latest")
#: the phases of the commit, which only rank 0 does
RANK0_PHASES = ("before_manifest", "before_latest")
HOWS = ("raise", "enospc", "eacces", "crash", "stall", "slow")
SLOW_S = 1.0


class InjectedFault(RuntimeError):
    """The `raise` fault."""


class InjectedCrash(BaseException):
    """The `crash` fault: not an `Exception`, so the save's error handling does not catch it."""


def check(phase: str, rank: int, step: int | None = None) -> None:
    """Raise the fault `MOECTL_CKPT_FAIL` asks for at `phase` on `rank` (in the save of `step`), if any
    (ValueError if the variable is malformed)."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return
    for item in spec.split(","):
        body, _, at = item.strip().partition("@")
        parts = body.split(":")
        if (len(parts) not in (2, 3) or not parts[0].isdigit() or parts[1] not in PHASES
                or (at and not at.isdigit())):  # fmt: skip
            raise ValueError(f"{ENV}={spec!r}: each item must be <rank>:<{'|'.join(PHASES)}>[:<how>][@<step>]")
        how = parts[2] if len(parts) == 3 else "raise"
        if how not in HOWS:
            raise ValueError(f"{ENV}={spec!r}: how must be one of {', '.join(HOWS)}, got {how!r}")
        if parts[1] in RANK0_PHASES and parts[0] != "0":
            raise ValueError(f"{ENV}={spec!r}: {parts[1]} happens on rank 0 only")
        if int(parts[0]) != rank or parts[1] != phase or (at and step != int(at)):
            continue
        message = f"injected fault {ENV}={item.strip()}"
        if how == "crash":
            raise InjectedCrash(message)
        if how == "enospc":
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({message})")
        if how == "eacces":
            raise PermissionError(errno.EACCES, f"{os.strerror(errno.EACCES)} ({message})")
        if how == "stall":
            while True:
                time.sleep(1)
        if how == "slow":
            time.sleep(SLOW_S)
            continue
        raise InjectedFault(message)
