"""The RNG states a checkpoint records (ckpt/logical.py: rng_state) and parity's snapshot of them."""

from __future__ import annotations

import pytest
import torch

from ckpt.logical import restore_rng, rng_state
from trainer.parity import _rng_state


def test_a_cpu_run_on_a_gpu_host_makes_no_cuda_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking CUDA for its RNG state initialises it: every rank of a `train.device=cpu` run on a GPU host made
    a context on GPU 0 at each save (and parity at each run)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a: pytest.fail("asked CUDA for its RNG state"))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("asked CUDA for its RNG states"))
    assert set(rng_state()) == {"torch"}
    assert "cuda" not in _rng_state()


def test_the_torch_state_round_trips() -> None:
    state = rng_state()
    expected = torch.rand(4)
    torch.rand(7)
    restore_rng({"rng": state})
    assert torch.equal(torch.rand(4), expected)
