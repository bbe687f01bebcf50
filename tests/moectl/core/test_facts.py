"""The device-dependent defaults, one definition for the engine and the rules (moectl/core/facts.py)."""

from __future__ import annotations

import pytest
import torch

from moectl.core.config.schema import Config
from moectl.core.facts import fuses_wgrad, resolved_expert_backend
from trainer.build import fuses_wgrad as engine_fuses_wgrad
from trainer.moe.backends import get_backend


def test_auto_backend_is_fused_on_cuda_and_grouped_elsewhere() -> None:
    assert resolved_expert_backend("auto", "cuda") == "fused"
    assert resolved_expert_backend("auto", "cpu") == "grouped"
    assert resolved_expert_backend("loop", "cuda") == "loop"  # a named backend is what it says
    assert get_backend("auto", "cpu").name == "grouped"  # the engine resolves through the same fact


@pytest.mark.parametrize("optimizer", ["adam", "muon", "sgd"])
@pytest.mark.parametrize("fusion", [None, True, False])
@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_null_fusion_is_on_for_cuda_under_buffered_optimizers(optimizer: str, fusion: bool | None, kind: str) -> None:
    expected = fusion if fusion is not None else (kind == "cuda" and optimizer != "sgd")
    assert fuses_wgrad(fusion, optimizer, kind) is expected
    cfg = Config()
    cfg.optimizer.optimizer, cfg.parallel.gradient_accumulation_fusion = optimizer, fusion
    assert engine_fuses_wgrad(cfg, torch.device(kind)) is expected  # the engine's wrapper reads the same fact
