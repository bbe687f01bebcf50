"""One line and one exit code for a multi-rank run, from each rank's report and what torchrun saw.

The cause is named in this order:
1. a rank that failed on its own (a `MoectlError`, or a crash): its own line, with its exit code;
2. a run a second Ctrl-C aborted: 130 and one line naming the last good checkpoint (a rank that saw another
   abort a moment before it, as a lost peer, is that abort's consequence, not a failure);
3. a rank that ended without a report (killed, aborted, or hung and then ended by the launcher): named
   with its signal or exit code, and - when the others timed out waiting for it - as hung. Where several
   ended so, the first to end is named: on GPUs a rank waiting in NCCL for a dead peer never reports, and
   the launcher kills it once its shutdown timeout has passed;
4. otherwise the first report of a lost peer or a timeout.
A run where every rank finished is 0; where every rank stopped on a signal, their common code (3 after a
save, 128 + N without one: moectl/cli/exit_codes.py), and so is a run the launcher's signal ended during
start-up (no rank began a step), whatever report its ranks had time to write: a scheduler's early
pre-emption is no crash. A failed run's line ends with the checkpoint to resume from, or says that nothing
was saved.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Optional

from moectl.cli import exit_codes
from moectl.cli import outcome as O


@dataclass(frozen=True)
class Exit:
    """How one rank's process ended, as torchrun reported it (only ranks that did not exit 0)."""

    code: int
    signal: Optional[str] = None  # e.g. "SIGKILL" when it died of a signal
    at: Optional[float] = None  # when torchrun saw it end (seconds since the epoch), where known


@dataclass(frozen=True)
class Verdict:
    """The run's exit code, and the one line to print (None when the ranks already said everything)."""

    code: int
    line: Optional[str]


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def _during(step: Optional[int], started: bool = False) -> str:
    """When it happened: in `step`; else `started` (a rank began a step, no report says which) or not."""
    if step is not None:
        return f"during step {step}"
    return "during training" if started else "before the first step"


def _first_checkpoint(outcomes: dict[int, O.Outcome]) -> Optional[str]:
    """The checkpoint the lowest rank that names one reports."""
    return next((o.checkpoint for _, o in sorted(outcomes.items()) if o.checkpoint), None)


def _resume_hint(outcomes: dict[int, O.Outcome], saves: bool, marked: Optional[str] = None) -> str:
    """The fix's checkpoint: one a report names, else the one rank 0 `marked` (no rank reported)."""
    ckpt = _first_checkpoint(outcomes) or marked
    if ckpt is None:
        if saves:  # set, and no save was reached (or none committed) before the end
            return "no checkpoint was saved before it ended; run it again"
        return "nothing was saved (set checkpoint.save_interval to make a run resumable)"
    parent = ckpt.rsplit("/", 1)[0] if "/" in ckpt else ckpt
    return f"resume from {ckpt} with --set checkpoint.load={parent}"


def aborted_line(step: Optional[int], checkpoint: Optional[str], saves: bool, started: bool = False) -> str:
    """The one line of a run a second Ctrl-C aborted in `step`: which checkpoint is the last good one (what
    `latest` names) and how to resume from it, or that there is none. `started`: a step had begun, though
    no report says which (its ranks were killed)."""
    when = " " + _during(step) if step is not None or not started else ""
    head = f"aborted by a second Ctrl-C{when}, without saving"
    if checkpoint is None:
        return f"{head}; " + ("no checkpoint was saved" if saves else
                              "nothing was saved (checkpoint.save_interval is not set)")  # fmt: skip
    parent = checkpoint.rsplit("/", 1)[0] if "/" in checkpoint else checkpoint
    return f"{head}; the last good checkpoint is {checkpoint}: resume with --set checkpoint.load={parent}"


def _how_it_ended(rank: int, exits: dict[int, Exit]) -> str:
    e = exits.get(rank)
    if e is None:
        return "ended without a report"
    if e.signal:
        return f"was killed by {e.signal}"
    return f"exited with code {e.code} without a report"


def _the_others(first: int, rest: list[int], exits: dict[int, Exit]) -> str:
    """How the other unreported ranks ended, after `first`: "; so did rank 2" (the same way, as soon as torchrun
    can tell), "; then ranks 0, 3 were killed by SIGKILL" (later: e.g. left waiting for it in NCCL, and killed
    once the launcher's shutdown timeout passed), grouped by how they ended."""
    t0, how0 = _ended_at(first, exits), _how_it_ended(first, exits)
    groups: dict[tuple[bool, str], list[int]] = {}
    for r in rest:
        groups.setdefault((_ended_at(r, exits) > t0, _how_it_ended(r, exits)), []).append(r)
    out = ""
    for (later, how), ranks in groups.items():
        if not later and how == how0:
            out += f"; so did {_ranks(sorted(ranks))}"
        else:
            verb = how.replace("was ", "were ", 1) if len(ranks) > 1 else how
            out += f"; {'then ' if later else ''}{_ranks(sorted(ranks))} {verb}"
    e = exits.get(first)
    if e is not None and e.signal == "SIGABRT" and any(later for later, _ in groups):
        # NCCL's watchdog takes a rank down so (TORCH_NCCL_ASYNC_ERROR_HANDLING's default) when its collective
        # times out; the rank it waited for is then killed after the shutdown timeout, and ends last
        out += ("; a SIGABRT is also how NCCL's watchdog ends a rank whose collective timed out, so the ranks that "
                "ended later may have hung")
    return out


def _ended_at(rank: int, exits: dict[int, Exit]) -> float:
    e = exits.get(rank)
    return e.at if e is not None and e.at is not None else float("inf")


def verdict(world_size: int, outcomes: dict[int, O.Outcome], exits: dict[int, Exit],
            launcher_signal: Optional[str] = None, saves: bool = False,
            started: frozenset[int] | set[int] = frozenset(), aborted: bool = False,
            checkpoint: Optional[str] = None) -> Verdict:  # fmt: skip
    """The verdict on a run of `world_size` ranks (see the module docstring). `saves`: whether the run's config
    saves checkpoints (`checkpoint.save_interval` set), for the fix of a run that ended with none. `started`: the
    ranks that began a step (`outcome.mark_started`): with none, a run the launcher's signal ended was still
    starting; a killed rank writes no report, so a run hung at step 5000 and then signalled leaves a mark.
    `aborted`: the launcher asked for the abort (a second Ctrl-C), so a rank that did not report was killed
    for it; `checkpoint`: the newest committed checkpoint rank 0 marked (`outcome.mark_checkpoint`), the last
    good one when no report names it."""
    own = [r for r, o in sorted(outcomes.items()) if o.kind in (O.ERROR, O.CRASH)]
    if own:
        first = outcomes[own[0]]
        same = [r for r in own if outcomes[r].message == first.message]
        return Verdict(first.exit_code or exit_codes.FAILED,
                       f"{_ranks(same)}, {_during(first.step).replace('during ', '')}: {first.message}")
    missing = [r for r in range(world_size) if r not in outcomes]
    steps = [o.step for o in outcomes.values() if o.step is not None]
    step = max(steps) if steps else None
    if any(o.kind == O.ABORTED for o in outcomes.values()) or (aborted and missing):
        ckpt = _first_checkpoint(outcomes) or checkpoint
        return Verdict(exit_codes.stopped_unsaved(signal.SIGINT), aborted_line(step, ckpt, saves, bool(started)))
    if missing:
        timed_out = sorted(r for r, o in outcomes.items() if o.kind == O.TIMEOUT)
        lost = sorted(r for r, o in outcomes.items() if o.kind == O.PEER_LOST)
        found = {r: i for i, r in enumerate(exits)}  # torchrun's order of finding them ended: its time is in seconds
        missing.sort(key=lambda r: (_ended_at(r, exits), found.get(r, len(found)), r))
        m = missing[0]
        how = _how_it_ended(m, exits)
        if timed_out:
            t = outcomes[timed_out[0]].timeout_s
            waited = f" after {t:g} s" if t is not None else ""
            cause = (f"rank {m} hung {_during(step)}: {_ranks(timed_out)} timed out{waited} waiting for it in a "
                     f"collective, then it {how}")
        elif launcher_signal and all(o.kind == O.STOPPED for o in outcomes.values()):
            if step is None and not started:  # asked to stop while starting: it did, and there is nothing to resume
                return Verdict(exit_codes.stopped_unsaved(signal.Signals[launcher_signal]),
                               f"stopped by {launcher_signal} during start-up, before the first step: nothing was "
                               "trained or saved")  # fmt: skip
            cause = f"rank {m} did not stop within the shutdown timeout after {launcher_signal} and {how}"
        else:
            seen = f" ({_ranks(lost)} lost it in a collective)" if lost else ""
            cause = f"rank {m} {how} {_during(step, bool(started))}{seen}"
        others = _the_others(m, missing[1:], exits)
        return Verdict(exit_codes.FAILED, f"{cause}{others}. fix: {_resume_hint(outcomes, saves, checkpoint)}")
    kinds = {o.kind for o in outcomes.values()}
    if kinds <= {O.FINISHED}:
        return Verdict(exit_codes.FINISHED, None)
    if kinds <= {O.FINISHED, O.STOPPED}:
        return Verdict(max(o.exit_code for o in outcomes.values()), None)
    r, o = next((r, o) for r, o in sorted(outcomes.items()) if o.kind in (O.TIMEOUT, O.PEER_LOST, O.PEER_FAILED))
    return Verdict(exit_codes.FAILED, f"{o.message.split('. fix:')[0]}. fix: {_resume_hint(outcomes, saves)}")
