"""Recipe weights quantized once per optimizer step (trainer/step_weights.py): the same training, bit for bit,
with a quarter of the weight quantizations, and nothing stale after the update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moectl.core.config.load import load_config
from trainer.loop import Trainer
from trainer.observer import SilentObserver
from trainer.precision.recipes.base import Recipe
from trainer.step_weights import StepWeights

FAST = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=32", "model.vocab_size=256", "moe.num_experts=4", "moe.ffn_hidden_size=16",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.eval_iters=1", "data.source=synthetic",
    "optimizer.lr_warmup_iters=0", "optimizer.lr=1e-2", "mixed_precision.bf16=true", "train.train_iters=3",
    "train.eval_interval=1", "train.deterministic=true", "logging.jsonl=false",
]  # 4 micro-batches per step, an evaluation after every step


def make(tmp_path: Path, *extra: str) -> Trainer:
    return Trainer(load_config(None, [*FAST, f"run_dir={tmp_path / 'run'}", *extra]), SilentObserver())


def count_weight_quantizations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = Recipe.quantize_weight
    monkeypatch.setattr(Recipe, "quantize_weight", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    return calls


@pytest.mark.parametrize("sets", [
    ["mixed_precision.fp8=e4m3"],
    ["mixed_precision.fp8=e4m3", "moe.single_grouped_weight=false", "moe.backend=fused"],
    ["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=mxfp8"],
], ids=["tensorwise", "tensorwise-per-expert-fused", "mxfp8"])  # fmt: skip
def test_once_per_step_trains_bitwise_like_once_per_micro_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sets: list[str]
) -> None:
    calls = count_weight_quantizations(monkeypatch)
    per_micro = make(tmp_path / "a", *sets)
    per_micro.step_weights = None  # every forward quantizes its weights, as before
    base = per_micro.run()
    n_micro_quantize, calls[:] = len(calls), []
    once = make(tmp_path / "b", *sets)
    assert once.step_weights is not None and len(once.step_weights.sites) == 2 * 2 + 2 * 2  # qkv, proj, fc1, fc2
    got = once.run()
    assert got.losses == base.losses and got.eval_losses == base.eval_losses
    for (n, p), q in zip(once.model.named_parameters(), per_micro.model.parameters()):
        assert torch.equal(p, q), n
    # before: every training forward (4 per step) and every eval forward (1 after each step) quantized 8
    # weights; now 8 before the first step and 8 after each update, which the evaluations read too
    assert n_micro_quantize == 3 * 4 * 8 + 3 * 8 and len(calls) == 4 * 8
    for module, recipe, weight in once.step_weights.sites:  # what stays installed is current, not stale
        fresh = recipe.quantize_weight(weight(), columnwise=False)
        assert torch.equal(module.quantized_weight.rowwise.data.view(torch.uint8), fresh.rowwise.data.view(torch.uint8))


def test_a_failed_step_leaves_no_quantized_weight_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = make(tmp_path, "mixed_precision.fp8=e4m3")
    assert t.step_weights is not None

    def boom(*a: object, **k: object) -> None:
        assert all(m.quantized_weight is not None for m, _, _ in t.step_weights.sites)  # published for the step
        raise RuntimeError("boom")

    monkeypatch.setattr(t.model, "loss", boom)
    with pytest.raises(RuntimeError, match="boom"):
        t.train_step(0)
    assert all(m.quantized_weight is None for m, _, _ in t.step_weights.sites)


def test_stateful_recipes_and_param_gather_keep_their_own_weights(tmp_path: Path) -> None:
    # delayed scaling records every weight quantization's amax: publishing once would record a quarter of them
    delayed = make(tmp_path / "d", "mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=delayed")
    assert delayed.step_weights is None and StepWeights(delayed.model).sites == []
    gather = make(tmp_path / "g", "mixed_precision.fp8=e4m3", "mixed_precision.fp8_param_gather=true")
    assert gather.step_weights is None
    plain = make(tmp_path / "b")
    assert plain.step_weights is None and StepWeights(plain.model).sites == []  # no recipe: no per-step sync
