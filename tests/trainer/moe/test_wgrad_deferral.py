"""`moe.defer_expert_wgrad` (trainer/moe/wgrad_deferral.py): every micro-batch but the last keeps its expert wgrad
operands, the last adds all their products. On the CPU the reference adds them in the same order as the
undeferred step, so the runs are bitwise equal there (the GPU kernel sums them in one accumulator: close)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moectl.core.config.load import load_config
from moectl.core.config.schema import MoEConfig
from trainer.main_grad import attach_main_grads
from trainer.loop import Trainer
from trainer.moe import GroupedMLP, wgrad_deferral
from trainer.observer import SilentObserver

FAST = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=32", "model.vocab_size=256", "moe.num_experts=4", "moe.ffn_hidden_size=16",
    "train.micro_batch_size=2", "train.global_batch_size=8", "data.source=synthetic", "train.eval_interval=null",
    "optimizer.lr_warmup_iters=0", "moe.backend=fused", "parallel.gradient_accumulation_fusion=true",
]
CPU = ["train.device=cpu"]  # the reference path: the same adds in the same order


def _train(tmp_path: Path, name: str, extra: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[list, dict, list]:
    stashed: list[int] = []
    real = wgrad_deferral.WgradStash.take

    def take(self):  # how many micro-batches each flush found kept
        entries = real(self)
        stashed.append(len(entries))
        return entries

    monkeypatch.setattr(wgrad_deferral.WgradStash, "take", take)
    cfg = load_config(None, [*FAST, *extra, f"run_dir={tmp_path / name}"])
    trainer = Trainer(cfg, SilentObserver())
    records = [trainer.train_step(step) for step in range(3)]
    trainer.engine.sync_params_for_eval()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return [(r["loss"], r["grad_norm"]) for r in records], params, stashed


def test_every_fourth_and_the_last_micro_batch_flush() -> None:
    assert [wgrad_deferral.defers(m, 9) for m in range(9)] == [True, True, True, False] * 2 + [False]
    assert [wgrad_deferral.defers(m, 2) for m in range(2)] == [True, False]


@pytest.mark.parametrize(("layout", "batch", "found"), [("true", 8, [3]), ("false", 8, [3]), ("true", 22, [3, 3, 2])],
                         ids=["grouped", "per-expert", "grouped-11-micro-batches"])
def test_deferred_expert_wgrads_train_bitwise_as_undeferred_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       layout: str, batch: int, found: list) -> None:
    extra = [f"moe.single_grouped_weight={layout}", f"train.global_batch_size={batch}"]
    checks: list[int] = []
    real_check = wgrad_deferral.check_flushed
    monkeypatch.setattr(wgrad_deferral, "check_flushed", lambda: (checks.append(1), real_check()))
    numbers, params, stashed = _train(tmp_path, "defer", [*CPU, *extra, "moe.defer_expert_wgrad=true"], monkeypatch)
    # per step and layer, each flush found the micro-batches kept since the last one (a fourth flushes)
    assert stashed == [n for _ in range(3) for n in found for _ in range(2)], stashed
    assert checks == [1, 1, 1]  # the loop checked after each step that nothing was left
    ref_numbers, ref_params, ref_stashed = _train(tmp_path, "ref", [*CPU, *extra], monkeypatch)
    assert ref_stashed == []  # undeferred: nothing kept, nothing taken
    assert numbers == ref_numbers
    for n, p in params.items():
        assert torch.equal(p, ref_params[n]), n


def _mlp() -> GroupedMLP:
    cfg = MoEConfig(num_experts=3, ffn_hidden_size=16, backend="fused")
    mlp = GroupedMLP(cfg, 32, init_std=0.3, generator=torch.Generator().manual_seed(0), gradient_accumulation_fusion=True)
    attach_main_grads(mlp)
    return mlp


def _micro(mlp: GroupedMLP, rows: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([rows // 2, 0, rows - rows // 2])
    x = torch.randn(rows, 32, generator=g, requires_grad=True)
    mlp(x, counts, torch.rand(rows, generator=g)).backward(torch.randn(rows, 32, generator=g))


def _grads(mlp: GroupedMLP) -> list[torch.Tensor]:
    return [p.main_grad.clone() for p in mlp.parameters()]


def test_a_last_micro_batch_without_rows_still_adds_the_kept_ones() -> None:
    ref = _mlp()
    for seed in (1, 2):
        _micro(ref, 8, seed)
    mlp = _mlp()
    for seed in (1, 2):
        with wgrad_deferral.micro_batch_phase(True):
            _micro(mlp, 8, seed)
    assert len(mlp.wgrad_stash.entries) == 2 and all(float(g.abs().sum()) == 0 for g in _grads(mlp))
    with wgrad_deferral.micro_batch_phase(False):
        _micro(mlp, 0, 3)  # no rows routed here in the last micro-batch
    assert mlp.wgrad_stash.entries == []
    for got, want in zip(_grads(mlp), _grads(ref)):
        assert torch.equal(got, want)


def test_a_flush_without_rows_overwrites_stale_grads_with_the_kept_ones() -> None:
    from trainer.main_grad import STALE_ATTR

    def flagged(mlp: GroupedMLP) -> torch.Tensor:
        weights = [p for n, p in mlp.named_parameters() if "weight" in n]
        flags = torch.ones(len(weights), dtype=torch.int32)
        for i, p in enumerate(weights):  # zero_grad skipped the fill: leftovers that read as zero
            setattr(p, STALE_ATTR, flags[i:i + 1])
            p.main_grad.fill_(float("nan"))
        return flags

    ref = _mlp()
    flagged(ref)
    for seed in (1, 2):
        _micro(ref, 8, seed)
    mlp = _mlp()
    flags = flagged(mlp)
    for seed in (1, 2):
        with wgrad_deferral.micro_batch_phase(True):
            _micro(mlp, 8, seed)
    assert flags.tolist() == [1] * len(flags)  # still stale: nothing was written
    with wgrad_deferral.micro_batch_phase(False):
        _micro(mlp, 0, 3)
    assert flags.tolist() == [0] * len(flags)
    for got, want in zip(_grads(mlp), _grads(ref)):
        assert torch.equal(got, want)


def test_a_copied_layer_has_its_own_registered_stash(tmp_path: Path) -> None:
    import copy

    mlp = copy.deepcopy(_mlp())
    attach_main_grads(mlp)  # a copy's params carry no main_grad of their own
    with wgrad_deferral.micro_batch_phase(True):
        _micro(mlp, 8, 1)
    with pytest.raises(RuntimeError, match="never flushed"):
        wgrad_deferral.check_flushed()
    wgrad_deferral.clear_all()
    assert mlp.wgrad_stash.entries == []


def test_zero_grad_drops_kept_operands_and_a_missed_flush_is_an_error(tmp_path: Path) -> None:
    mlp = _mlp()
    with wgrad_deferral.micro_batch_phase(True):
        _micro(mlp, 8, 1)
    with pytest.raises(RuntimeError, match="never flushed"):
        wgrad_deferral.check_flushed()
    cfg = load_config(None, [*FAST, *CPU, f"run_dir={tmp_path / 'run'}"])
    Trainer(cfg, SilentObserver()).engine.zero_grad()  # any engine's zero_grad: every stash goes
    assert mlp.wgrad_stash.entries == []
    wgrad_deferral.check_flushed()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graph", ["false", "true"])
def test_deferred_expert_wgrads_train_as_undeferred_on_the_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               graph: str) -> None:
    # bf16 and shapes the TMA kernel takes (fc1 rows a multiple of 128); graphs: each deferring micro-batch a variant
    extra = ["train.device=cuda", "mixed_precision.bf16=true", "model.hidden_size=128", "moe.ffn_hidden_size=128",
             f"train.cuda_graph={graph}"]
    numbers, _, stashed = _train(tmp_path, "defer", [*extra, "moe.defer_expert_wgrad=true"], monkeypatch)
    # each layer's flush found 3 kept micro-batches: every step eagerly; under graphs in the eager first step
    # and at the second's capture, then no Python runs (a replay that stopped deferring would not show here)
    assert stashed == ([3] * 4 if graph == "true" else [3] * 6)
    ref_numbers, _, _ = _train(tmp_path, "ref", extra, monkeypatch)
    for (loss, norm), (ref_loss, ref_norm) in zip(numbers, ref_numbers):
        assert loss == pytest.approx(ref_loss, rel=1e-4) and norm == pytest.approx(ref_norm, rel=1e-3)
