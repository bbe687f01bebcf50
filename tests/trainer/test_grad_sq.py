"""Sums of squares of final expert grads left by their wgrad for the grad norm (trainer/grad_sq.py): the
bookkeeping, and a training step whose norm reads them instead of the grads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moectl.core.config.load import load_config
from trainer import grad_sq
from trainer.loop import Trainer
from trainer.observer import SilentObserver


@pytest.fixture(autouse=True)
def _no_records():
    grad_sq.clear()
    yield
    grad_sq.clear()


def test_covered_grads_are_cut_out_of_the_counted_ranges_and_taken_once() -> None:
    buf = torch.arange(20, dtype=torch.float32)
    view = buf[2:18]  # the counted range
    grad_sq.record([buf[4:6], buf[6:9]], torch.tensor([1.0]))  # inside: taken
    grad_sq.record([buf[12:14]], torch.tensor([2.0]))  # inside: taken
    grad_sq.record([buf[16:19]], torch.tensor([3.0]))  # reaches past the range: counted elsewhere, left
    rest, partials = grad_sq.take_covered([view])
    assert sorted(float(p) for p in partials) == [1.0, 2.0]
    assert [r.tolist() for r in rest] == [[2.0, 3.0], [9.0, 10.0, 11.0], [14.0, 15.0, 16.0, 17.0]]
    rest, partials = grad_sq.take_covered([view])
    assert partials == [] and [r.numel() for r in rest] == [16]  # taken: read as before now
    assert len(grad_sq.recorded()) == 1


def test_a_later_record_replaces_and_none_forgets() -> None:
    buf = torch.zeros(8)
    grad_sq.record([buf[0:4]], torch.tensor([1.0]))
    grad_sq.record([buf[0:4]], torch.tensor([5.0]))
    assert [float(r.partials) for r in grad_sq.recorded()] == [5.0]
    grad_sq.record([buf[0:4]], None)
    assert grad_sq.recorded() == []


def test_other_dtypes_and_storages_are_never_covered() -> None:
    a, b = torch.zeros(8), torch.zeros(8)
    grad_sq.record([b[0:4]], torch.tensor([1.0]))
    grad_sq.record([a.view(torch.int32)[0:4]], torch.tensor([1.0]))
    rest, partials = grad_sq.take_covered([a])
    assert partials == [] and [r.numel() for r in rest] == [8]


def test_arming_is_scoped() -> None:
    assert not grad_sq.armed()
    with grad_sq.final_accumulation():
        assert grad_sq.armed()
        with grad_sq.final_accumulation(False):
            assert not grad_sq.armed()
        assert grad_sq.armed()
    assert not grad_sq.armed()


FAST = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=32", "model.vocab_size=256", "moe.num_experts=4", "moe.ffn_hidden_size=16",
    "train.micro_batch_size=2", "train.global_batch_size=6", "data.source=synthetic", "train.eval_interval=null",
    "optimizer.lr_warmup_iters=0", "optimizer.clip_grad=0.05",
    # what CUDA resolves by default (auto: grouped and unfused on the CPU)
    "moe.backend=fused", "parallel.gradient_accumulation_fusion=true",
]


def _norms(tmp_path: Path, name: str, extra: list[str], monkeypatch: pytest.MonkeyPatch,
           taken: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    real = grad_sq.take_covered

    def spy(views):  # the partials against the grads they stand for, read here (still unchanged)
        covered = list(grad_sq.recorded())
        rest, partials = real(views)
        for rec in covered:
            if any(rec.partials is p for p in partials):
                taken.append((float(rec.partials.double().sum()), sum(float(g.double().square().sum()) for g in rec.grads)))
        return rest, partials

    monkeypatch.setattr(grad_sq, "take_covered", spy)
    cfg = load_config(None, [*FAST, *extra, f"run_dir={tmp_path / name}"])
    trainer = Trainer(cfg, SilentObserver())
    records = [trainer.train_step(step) for step in range(3)]
    return [float(r["grad_norm"]) for r in records], [float(r["loss"]) for r in records]


@pytest.mark.parametrize("layout", ["true", "false"], ids=["grouped", "per-expert"])
@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_the_step_norm_reads_the_expert_grads_sums_of_squares(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              layout: str, optimizer: str) -> None:
    extra = [f"moe.single_grouped_weight={layout}", f"optimizer.optimizer={optimizer}"]
    taken: list[tuple[float, float]] = []
    norms, losses = _norms(tmp_path, "sq", extra, monkeypatch, taken)
    # every step took fc1 and fc2 of both layers, and each stood for its grads
    assert len(taken) == 3 * 2 * 2, taken
    for got, want in taken:
        assert got == pytest.approx(want, rel=1e-6) and want > 0  # per-tile fp32 sums on CUDA, fp64 on the CPU
    monkeypatch.setenv("MOECTL_GRAD_SQ", "0")
    ref_taken: list[tuple[float, float]] = []
    ref_norms, ref_losses = _norms(tmp_path, "ref", extra, monkeypatch, ref_taken)
    assert ref_taken == []
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert grad_sq.recorded() == []  # nothing outlives the step that took it


def test_unfused_expert_grads_are_read_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[tuple[float, float]] = []
    _norms(tmp_path, "unfused", ["moe.backend=grouped"], monkeypatch, taken)
    assert taken == []
