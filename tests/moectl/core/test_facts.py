"""The device-dependent defaults, one definition for the engine and the rules (moectl/core/facts.py)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from moectl.core.config.schema import Config
from moectl.core.facts import expert_capacity, fuses_wgrad, resolved_expert_backend
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


@pytest.mark.parametrize("factor", [2.0, 2.5, 1e6, 1e308, sys.float_info.max])
def test_capacity_is_at_most_the_tokens_for_any_finite_factor(factor: float) -> None:
    # 512 tokens, top-2 of 4 experts: from factor E/K = 2 on an expert could take every token; 1e308 overflowed
    # the product to inf (an OverflowError in the trainer's first forward after validate-config said valid)
    assert expert_capacity(factor, 512, 2, 4) == 512


def test_capacity_below_the_tokens_is_ceil_factor_tokens_topk_over_experts() -> None:
    for factor in (0.001, 0.5, 1.0, 1.25, 1.999, 1.9999999999):
        assert expert_capacity(factor, 512, 2, 4) == math.ceil(factor * 512 * 2 / 4) <= 512
    assert expert_capacity(1.25, 4096, 8, 64) == 640  # a Mixtral-like micro-batch: what Megatron's get_capacity gives
