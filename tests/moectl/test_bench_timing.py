"""moectl/bench/timing.py: the host-ahead (`queued_ms`) and steady-state (`sustained_ms`) regimes beside
per-call timing.

No timed assertion: the tests check what is measured and what is flagged, never how fast anything is."""

from __future__ import annotations

import time

import pytest
import torch

from moectl.bench import timing


def test_queued_is_cuda_only() -> None:
    calls: list[int] = []
    samples, behind = timing.queued_ms({"a": lambda: calls.append(1)}, torch.device("cpu"), rounds=2, calls=3)
    assert samples == {} and behind == set() and calls == []


@pytest.mark.gpu
def test_queued_samples_every_round_and_flags_a_host_that_falls_behind() -> None:
    dev = torch.device("cuda")
    x = torch.randn(256, 256, device=dev)
    fast = lambda: x @ x  # noqa: E731
    # 4 calls of 50 ms host work each cannot all be queued within the ~20 ms head start
    slow = lambda: (time.sleep(0.05), x @ x)  # noqa: E731
    samples, behind = timing.queued_ms({"fast": fast, "slow": slow}, dev, rounds=2, calls=4)
    assert set(samples) == {"fast", "slow"} and all(len(v) == 2 and min(v) > 0 for v in samples.values())
    assert behind == {"slow"}


def test_sustained_is_cuda_only() -> None:
    calls: list[int] = []
    assert timing.sustained_ms({"a": lambda: calls.append(1)}, torch.device("cpu"), rounds=2, seconds=0.1) == ({}, {})
    assert calls == []


@pytest.mark.gpu
def test_sustained_times_every_round_after_an_untimed_half_with_the_host_at_most_two_calls_ahead() -> None:
    dev = torch.device("cuda")
    counts = {"a": 0, "b": 0}
    mine: list[torch.cuda.Event] = []  # an event after each call's device work
    unfinished: list[int] = []  # how many earlier calls the device had not finished when a new one started

    def make(name: str):  # type: ignore[no-untyped-def]
        def fn() -> None:
            counts[name] += 1
            unfinished.append(sum(not e.query() for e in mine[-8:]))
            torch.cuda._sleep(2_000_000)  # ~1 ms of device time against microseconds of host time
            mine.append(torch.cuda.Event())
            mine[-1].record()

        return fn

    samples, states = timing.sustained_ms({"a": make("a"), "b": make("b")}, dev, rounds=2, seconds=0.1)
    assert set(samples) == {"a", "b"} and all(len(v) == 2 and min(v) > 0 for v in samples.values())
    assert set(states) == {"a", "b"} and all(len(v) == 2 for v in states.values())
    assert all(st.alloc_retries == 0 for v in states.values() for st in v)
    # per round: one sizing call, then two equal halves of at least 2 calls each
    assert all(n >= 2 * (1 + 2 * 2) and (n - 2) % 2 == 0 for n in counts.values())
    # paced: each call waits for the one two back, so at most one earlier call is still running (the device
    # is ~1000x slower than the host here: unpaced, all 8 looked at would be)
    assert max(unfinished) <= 1 and sum(unfinished) > 0
    # on a machine with NVML or nvidia-smi the readings are real numbers (the device tool's machines have the tool)
    mhz, watts = timing.clock_and_power(dev)
    assert (mhz is None) == (watts is None) and (mhz is None or (mhz > 0 and watts > 0))
    assert timing.sustained_ms({"a": make("a")}, dev, rounds=1, seconds=0.0) == ({}, {})
