"""The per-bucket-group param-sync state machine: one explicit state instead of scattered flags.

    idle --stage--> staged --dispatch--> dispatched --wait--> gathered --post_process--> post_processed
                      |  \\________________gather (synchronous)________/^                      |
                      +--stage (re-stage after zeroing)       post_processed --stage--> staged

Every action not in `TRANSITIONS` raises `ParamSyncError`. Each illegal transition is a Megatron bug
that a flag-based design allowed:
- stage while dispatched: overwriting a buffer being sent (or, with a stale "dispatched" flag after a
  forced sync, the pre-hook skipping the next gather and zeroing: grad-norm spikes after eval, #5464);
- stage while gathered: gathered values that were never post-processed are lost (#4562);
- dispatch while dispatched, or from post_processed: a second gather of the same buckets (mixed bucket
  groups synced twice, #6754) or a gather of values nobody staged (a zeroed staging buffer, #4987);
- post_process twice, or before the gather finished;
- reset with a handle in flight (or with a gather staged/gathered but not consumed): a silent skip.
Staging always leads to `staged`, so a dispatch can never be believed done when it is not.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable


class ParamSyncState(Enum):
    IDLE = "idle"
    STAGED = "staged"
    DISPATCHED = "dispatched"
    GATHERED = "gathered"
    POST_PROCESSED = "post_processed"


class Action(Enum):
    STAGE = "stage"
    DISPATCH = "dispatch"  # start an async all-gather
    GATHER = "gather"  # synchronous all-gather (forced sync, or overlap off)
    WAIT = "wait"
    POST_PROCESS = "post_process"
    RESET = "reset"


S, A = ParamSyncState, Action
TRANSITIONS: dict[tuple[ParamSyncState, Action], ParamSyncState] = {
    (S.IDLE, A.STAGE): S.STAGED,
    (S.STAGED, A.STAGE): S.STAGED,
    (S.POST_PROCESSED, A.STAGE): S.STAGED,
    (S.STAGED, A.DISPATCH): S.DISPATCHED,
    (S.STAGED, A.GATHER): S.GATHERED,
    (S.DISPATCHED, A.WAIT): S.GATHERED,
    (S.GATHERED, A.POST_PROCESS): S.POST_PROCESSED,
    (S.IDLE, A.RESET): S.IDLE,
    (S.POST_PROCESSED, A.RESET): S.IDLE,
}

#: States in which the params hold the newest values (no gather pending or unfinished).
SETTLED = frozenset({S.IDLE, S.POST_PROCESSED})

_WHY: dict[tuple[ParamSyncState, Action], str] = {
    (S.DISPATCHED, A.STAGE): "a gather is in flight from the buffer being staged into",
    (S.GATHERED, A.STAGE): "gathered values have not been post-processed yet and would be lost",
    (S.IDLE, A.DISPATCH): "nothing was staged; the gather would ship stale or zeroed values",
    (S.POST_PROCESSED, A.DISPATCH): "this step's values were already gathered; a second gather is a double sync",
    (S.DISPATCHED, A.DISPATCH): "a gather of this group is already in flight",
    (S.GATHERED, A.DISPATCH): "this group was already gathered",
    (S.IDLE, A.GATHER): "nothing was staged; the gather would ship stale or zeroed values",
    (S.POST_PROCESSED, A.GATHER): "this step's values were already gathered; a second gather is a double sync",
    (S.DISPATCHED, A.GATHER): "an async gather is in flight; wait for it instead",
    (S.GATHERED, A.GATHER): "this group was already gathered",
    (S.POST_PROCESSED, A.POST_PROCESS): "post-processing twice",
    (S.DISPATCHED, A.RESET): "a gather handle is in flight",
    (S.STAGED, A.RESET): "staged values would never be gathered",
    (S.GATHERED, A.RESET): "gathered values would never be post-processed",
}


class ParamSyncError(RuntimeError):
    """An illegal param-sync transition: a bug in the caller's sequencing, never a user error."""


class ParamSyncMachine:
    """The state of one bucket group's param sync, plus the in-flight handles while dispatched."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = ParamSyncState.IDLE
        self.handles: list[Any] = []

    def can(self, action: Action) -> bool:
        return (self.state, action) in TRANSITIONS

    def apply(self, action: Action) -> ParamSyncState:
        """Move to the next state or raise; the caller does the work before calling (so a failure leaves it)."""
        nxt = TRANSITIONS.get((self.state, action))
        if nxt is None:
            why = _WHY.get((self.state, action), "not a legal transition")
            raise ParamSyncError(f"{self.name}: cannot {action.value} in state {self.state.value}: {why}")
        if action is Action.RESET and self.handles:
            raise ParamSyncError(f"{self.name}: cannot reset: a gather handle is in flight")
        self.state = nxt
        return nxt

    def check(self, action: Action) -> None:
        """Raise now if `action` is illegal, before doing any work for it."""
        if not self.can(action):
            why = _WHY.get((self.state, action), "not a legal transition")
            raise ParamSyncError(f"{self.name}: cannot {action.value} in state {self.state.value}: {why}")

    def run(self, action: Action, work: Callable[[], Any] | None = None) -> Any:
        """Check, do `work`, then transition: the state only moves once the work succeeded."""
        self.check(action)
        result = work() if work is not None else None
        self.apply(action)
        return result
