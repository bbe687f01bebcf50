"""moectl/bench/timing.py: the host-ahead (`queued_ms`) regime beside per-call timing.

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
