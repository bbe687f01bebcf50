"""The param-sync state machine, transition by transition, and its use by bucket groups (one process)."""

from __future__ import annotations

import itertools

import pytest

from trainer.distributed.param_sync import (
    TRANSITIONS,
    Action,
    ParamSyncError,
    ParamSyncMachine,
    ParamSyncState,
)

S, A = ParamSyncState, Action

EXPECTED_LEGAL = {
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


def machine_in(state: ParamSyncState) -> ParamSyncMachine:
    m = ParamSyncMachine("test group")
    m.state = state
    return m


def test_transition_table_is_exactly_the_documented_one() -> None:
    assert TRANSITIONS == EXPECTED_LEGAL


@pytest.mark.parametrize(("state", "action"), list(itertools.product(S, A)), ids=lambda v: v.value)
def test_every_transition(state: ParamSyncState, action: Action) -> None:
    m = machine_in(state)
    if (state, action) in EXPECTED_LEGAL:
        assert m.can(action)
        assert m.apply(action) is EXPECTED_LEGAL[(state, action)]
        assert m.state is EXPECTED_LEGAL[(state, action)]
    else:
        assert not m.can(action)
        with pytest.raises(ParamSyncError, match=f"cannot {action.value} in state {state.value}"):
            m.apply(action)
        assert m.state is state  # an illegal action changes nothing


def test_illegal_transitions_say_why() -> None:
    with pytest.raises(ParamSyncError, match="in flight"):
        machine_in(S.DISPATCHED).apply(A.RESET)
    with pytest.raises(ParamSyncError, match="would be lost"):
        machine_in(S.GATHERED).apply(A.STAGE)
    with pytest.raises(ParamSyncError, match="double sync"):
        machine_in(S.POST_PROCESSED).apply(A.DISPATCH)
    with pytest.raises(ParamSyncError, match="stale or zeroed"):
        machine_in(S.IDLE).apply(A.GATHER)


def test_staging_resets_dispatch() -> None:
    """The Megatron #5464 sequence: forced sync, then stage: the next hook must gather again."""
    m = machine_in(S.STAGED)
    for action in (A.GATHER, A.POST_PROCESS, A.STAGE):  # a forced sync, then the next step's staging
        m.apply(action)
    assert m.state is S.STAGED and m.can(A.DISPATCH)


def test_reset_with_handle_in_flight_is_an_error() -> None:
    m = machine_in(S.POST_PROCESSED)
    m.handles.append(object())  # a handle that somehow outlived its gather
    with pytest.raises(ParamSyncError, match="handle is in flight"):
        m.apply(A.RESET)


def test_run_moves_only_after_the_work_succeeds() -> None:
    m = machine_in(S.STAGED)

    def boom() -> None:
        raise RuntimeError("collective failed")

    with pytest.raises(RuntimeError, match="collective failed"):
        m.run(A.DISPATCH, boom)
    assert m.state is S.STAGED
    calls = []
    with pytest.raises(ParamSyncError):
        machine_in(S.IDLE).run(A.DISPATCH, lambda: calls.append(1))
    assert calls == []  # an illegal action does no work


def test_full_cycle_twice() -> None:
    m = ParamSyncMachine("g")
    for _ in range(2):
        for action in (A.STAGE, A.DISPATCH, A.WAIT, A.POST_PROCESS):
            m.apply(action)
    assert m.state is S.POST_PROCESSED
    m.apply(A.RESET)
    assert m.state is S.IDLE
