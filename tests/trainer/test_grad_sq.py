"""Sums of squares of final expert grads left by their wgrad for the grad norm (trainer/grad_sq.py): the
bookkeeping, and a training step whose norm reads them instead of the grads."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from dist_helpers import run_distributed
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


class _FakeGraph:
    """`torch.cuda.CUDAGraph` on the CPU: a replay runs nothing (as no Python runs in a real one)."""

    replays = 0

    def replay(self) -> None:
        _FakeGraph.replays += 1

    def pool(self) -> None:
        return None


def test_a_graph_replay_records_again_what_its_armed_capture_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from trainer.graphs import capture

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    grads, calls = torch.zeros(4), []

    def loss_fn(tokens, targets):  # stands for a backward whose wgrad kernel records when armed
        calls.append(grad_sq.armed())
        if grad_sq.armed():
            grad_sq.record([grads], torch.tensor([7.0]))
        w = torch.ones((), requires_grad=True)
        return SimpleNamespace(total=w * 2, lm_loss=w.detach(), aux_loss=w.detach())

    graph = capture.MicroBatchGraph(torch.nn.Linear(1, 1), loss_fn, n_micro=2)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    graph.run(tokens, tokens)  # captures the plain variant
    assert grad_sq.recorded() == []
    graph.run(tokens, tokens, final_sq=True)  # captures the armed one
    assert calls == [False, True] and [float(r.partials) for r in grad_sq.recorded()] == [7.0]
    grad_sq.clear()  # the next step's zero_grad
    graph.run(tokens, tokens)
    assert grad_sq.recorded() == []
    graph.run(tokens, tokens, final_sq=True)  # a replay: no Python ran, the capture's record comes back
    assert calls == [False, True] and [float(r.partials) for r in grad_sq.recorded()] == [7.0]


def test_an_armed_backward_that_adds_without_partials_drops_the_old_record() -> None:
    from moectl.core.config.schema import MoEConfig
    from trainer.main_grad import attach_main_grads
    from trainer.moe import GroupedMLP

    cfg = MoEConfig(num_experts=3, ffn_hidden_size=16, backend="fused")
    mlp = GroupedMLP(cfg, 32, init_std=0.3, generator=torch.Generator().manual_seed(0),
                     gradient_accumulation_fusion=True)
    attach_main_grads(mlp)
    counts = torch.tensor([3, 0, 5])
    with grad_sq.final_accumulation():
        mlp(torch.randn(8, 32, requires_grad=True), counts, torch.rand(8)).sum().backward()
    recs = grad_sq.recorded()
    assert len(recs) == 2  # fc1's and fc2's
    want = sum(float(p.main_grad.double().square().sum()) for p in mlp.parameters())
    assert sum(float(r.partials.double().sum()) for r in recs) == pytest.approx(want, rel=1e-12)
    with grad_sq.final_accumulation():  # no rows: the grads are added to (by nothing) without partials
        mlp(torch.randn(0, 32, requires_grad=True), counts * 0, torch.rand(0)).sum().backward()
    assert grad_sq.recorded() == []


def test_zeroing_the_grad_buffers_forgets_the_records(tmp_path: Path) -> None:
    cfg = load_config(None, [*FAST, f"run_dir={tmp_path / 'run'}"])
    trainer = Trainer(cfg, SilentObserver())
    grad_sq.record([torch.zeros(2)], torch.tensor([1.0]))
    trainer.engine.zero_grad()
    assert grad_sq.recorded() == []


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
                want = sum(float(g.double().square().sum()) for g in rec.grads)
                taken.append((float(rec.partials.double().sum()), want))
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


def _two_rank_norms(rank: int, world_size: int, root: str) -> dict[str, object]:
    import os

    real, taken = grad_sq.take_covered, []

    def spy(views):
        rest, partials = real(views)
        taken.extend(partials)
        return rest, partials

    grad_sq.take_covered = spy  # type: ignore[assignment]
    out: dict[str, object] = {}
    for switch in ("1", "0"):
        os.environ["MOECTL_GRAD_SQ"] = switch
        cfg = load_config(None, [*FAST, "train.global_batch_size=8", "parallel.use_distributed_optimizer=true",
                                 "train.device=cpu", f"run_dir={root}/run{switch}"])
        trainer = Trainer(cfg, SilentObserver())
        out[switch] = [float(trainer.train_step(step)["grad_norm"]) for step in range(2)]
    out["taken"] = len(taken)
    return out


@pytest.mark.slow
def test_two_data_parallel_ranks_read_every_grad(tmp_path: Path) -> None:
    # the grads are reduced and scaled after the backward: partials of the local grads would give a wrong norm
    for r in run_distributed(_two_rank_norms, world_size=2, timeout=300, root=str(tmp_path)):
        assert r["taken"] == 0
        assert r["1"] == r["0"]
