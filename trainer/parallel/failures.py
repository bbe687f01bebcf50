"""When another rank is the problem: a collective that lost its peer or timed out, and errors all ranks share.

torch.distributed reports both as a plain `RuntimeError` (gloo) or a `DistError` subclass, with the
backend's text ("Connection closed by peer", "Timed out waiting 6000ms for recv"). A user needs to read
instead: which rank, during which step, and what it means (another rank died, or hangs). These errors
are `MoectlError`s, so the CLI prints them as one line; the launcher (moectl/cli/launch.py) combines
the ranks' reports into one line for the whole run.

`raise_if_any_rank_failed` makes a check that can fail on one rank only (rank 0 preparing run_dir)
fail on all of them at once, instead of leaving the others to wait in the next collective until the
timeout.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist

from moectl.core.errors import MoectlError

# Backend texts, gloo's and NCCL's, that mean "the other side is gone" or "the other side never came".
_PEER_LOST = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|socket closed|remote process exited"
    r"|NCCL communicator was aborted|ncclRemoteError",
    re.IGNORECASE,
)
_TIMED_OUT = re.compile(r"timed out|timeout|watchdog caught collective operation", re.IGNORECASE)


class CollectiveFailure(MoectlError):
    """A collective failed because of another rank. `kind`: `timeout` (it never came: hung, stopped, or far
    slower) or `peer-lost` (it exited or crashed). `step` is the step in flight (None before the first)."""

    def __init__(self, kind: str, rank: int, step: int | None, timeout_s: float, detail: str) -> None:
        self.kind, self.rank, self.step, self.timeout_s, self.detail = kind, rank, step, timeout_s, detail
        where = f"during step {step}" if step is not None else "while starting the run"
        if kind == "timeout":
            super().__init__(
                f"rank {rank} timed out after {_human_seconds(timeout_s)} waiting in a collective {where}: "
                "another rank made no progress (hung, stopped, or far slower)",
                "find the rank that hangs (the launcher names it); if it is only slow, raise "
                "parallel.distributed_timeout_minutes; resume from the last checkpoint",
            )
        else:
            super().__init__(
                f"rank {rank} lost a peer {where}: another rank exited or crashed ({detail})",
                "see that rank's own error; resume from the last checkpoint",
            )


class PeerFailedError(MoectlError):
    """This rank stops because another rank failed a check first; that rank reports the cause itself."""

    def __init__(self, failed_ranks: list[int]) -> None:
        self.failed_ranks = failed_ranks
        ranks = ", ".join(map(str, failed_ranks))
        super().__init__(f"stopping because rank(s) {ranks} failed", "see that rank's error")


def _human_seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.3g} min"


def _is_distributed_error(e: BaseException) -> bool:
    dist_error = getattr(dist, "DistError", None)
    return (dist_error is not None and isinstance(e, dist_error)) or type(e) is RuntimeError


def collective_failure(e: BaseException, rank: int, step: int | None, timeout_s: float) -> CollectiveFailure | None:
    """`e` as a `CollectiveFailure` when it is a backend's report of a lost or late peer, else None."""
    if not _is_distributed_error(e):
        return None
    text = str(e)
    detail = " ".join(re.sub(r"^\[[^\]]*\]\s*", "", text).split())[:160]  # drop gloo's [file.cc:123]
    if _PEER_LOST.search(text):
        return CollectiveFailure("peer-lost", rank, step, timeout_s, detail)
    if _TIMED_OUT.search(text):
        return CollectiveFailure("timeout", rank, step, timeout_s, detail)
    return None


def raise_if_any_rank_failed(error: BaseException | None, group: Any, world_size: int) -> None:
    """Collective: every rank passes its own error (or None); if any rank has one, every rank raises.

    A failing rank raises its own error; the others raise `PeerFailedError` naming the failed ranks.
    """
    if world_size > 1:
        flags = torch.zeros(world_size, dtype=torch.int64)
        flags[dist.get_rank(group)] = int(error is not None)
        if dist.get_backend(group) == "nccl":
            flags = flags.cuda()
        dist.all_reduce(flags, group=group)
        failed = [r for r, f in enumerate(flags.tolist()) if f]
        if failed and error is None:
            raise PeerFailedError(failed)
    if error is not None:
        raise error
