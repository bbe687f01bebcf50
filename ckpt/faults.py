"""Fault injection for save tests: `MOECTL_CKPT_FAIL=<rank>:<phase>[:<how>]` (comma-separate several).

Phases, in the order a save reaches them (PyTorch DCP's `FaultyStorageWriter` injects at the same
points of its own protocol):
  write            on that rank, right after its first shard file is written ("crash after some files")
  finalize         on that rank, after all its files and their folder entries are fsynced, before the vote
  before_manifest  rank 0 only: after every rank voted ok, just before manifest.json (the commit marker)
How:
  raise  (default) an ordinary exception: the save fails on every rank, cleanly, naming that rank
  crash  an uncatchable `InjectedCrash` (BaseException) that skips all cleanup and collectives, leaving
         what a killed process leaves. Use it in single-process tests only: in a multi-rank run the
         other ranks would wait for the dead one until the process group times out, as with a real kill.
The variable is read at every check, so a test can set it in a child process.
"""

from __future__ import annotations

import os

ENV = "MOECTL_CKPT_FAIL"
PHASES = ("write", "finalize", "before_manifest")


class InjectedFault(RuntimeError):
    """The `raise` fault."""


class InjectedCrash(BaseException):
    """The `crash` fault: not an `Exception`, so the save's error handling does not catch it."""


def check(phase: str, rank: int) -> None:
    """Raise the fault `MOECTL_CKPT_FAIL` asks for at `phase` on `rank`, if any (ValueError if malformed)."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return
    for item in spec.split(","):
        parts = item.strip().split(":")
        if len(parts) not in (2, 3) or not parts[0].isdigit() or parts[1] not in PHASES:
            raise ValueError(f"{ENV}={spec!r}: each item must be <rank>:<{'|'.join(PHASES)}>[:raise|crash]")
        how = parts[2] if len(parts) == 3 else "raise"
        if how not in ("raise", "crash"):
            raise ValueError(f"{ENV}={spec!r}: how must be 'raise' or 'crash', got {how!r}")
        if parts[1] == "before_manifest" and parts[0] != "0":
            raise ValueError(f"{ENV}={spec!r}: before_manifest happens on rank 0 only")
        if int(parts[0]) == rank and parts[1] == phase:
            message = f"injected fault {ENV}={item.strip()}"
            raise InjectedCrash(message) if how == "crash" else InjectedFault(message)
