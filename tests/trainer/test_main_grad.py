"""Stale grads (trainer/main_grad.py): zero_grad flags the expert weights' grads instead of filling them, and
every writer leaves exactly what a zero fill then an add would have."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_helpers import run_distributed
from moectl.core.config.load import load_config
from trainer.distributed.buffers import BufferKey, ParamAndGradBuffer
from trainer.distributed.param_storage import HighPrecisionStorage
from trainer.loop import Trainer
from trainer.main_grad import STALE_ATTR, accumulate_wgrad, accumulate_wgrad_mm, stale_flag
from trainer.observer import SilentObserver
from trainer.parallel import ParallelState

BASE = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
    "model.seq_length=32", "moe.num_experts=4", "moe.router_topk=2", "moe.ffn_hidden_size=32",
    "moe.backend=fused", "parallel.gradient_accumulation_fusion=true",
    "train.micro_batch_size=2", "train.global_batch_size=6", "train.train_iters=4", "train.eval_interval=null",
    "logging.jsonl=false", "checkpoint.save_interval=null",
]  # fmt: skip


def _buffer(stale_ok: frozenset[torch.nn.Parameter], params: list[torch.nn.Parameter]) -> ParamAndGradBuffer:
    key = BufferKey(torch.float32, torch.float32, True, "adam", "hp")
    names = {p: f"p{i}" for i, p in enumerate(params)}
    return ParamAndGradBuffer(key, params, names, HighPrecisionStorage(), ParallelState.trivial().dp, 10**9,
                              stale_ok=stale_ok)


def test_zero_grad_flags_stale_capable_grads_and_fills_the_rest_padding_included() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 300, 7)]
    buf = _buffer(frozenset({params[1]}), params)
    buf.grad_data.fill_(3.0)  # leftovers everywhere, padding included
    buf.zero_grad()
    assert torch.equal(params[1].main_grad, torch.full((300,), 3.0))  # not filled: flagged
    assert int(stale_flag(params[1])) == 1  # type: ignore[arg-type]
    lo, hi = buf.param_ranges[params[1]]
    rest = torch.cat([buf.grad_data[:lo], buf.grad_data[hi:]])
    assert torch.equal(rest, torch.zeros_like(rest))
    assert stale_flag(params[0]) is None and stale_flag(params[2]) is None


def test_rewrapping_drops_an_earlier_buffers_flag() -> None:
    params = [torch.nn.Parameter(torch.zeros(8))]
    _buffer(frozenset(params), params).zero_grad()
    assert hasattr(params[0], STALE_ATTR)
    _buffer(frozenset(), params)
    assert not hasattr(params[0], STALE_ATTR)


def test_adding_writers_settle_a_stale_grad_first() -> None:
    params = [torch.nn.Parameter(torch.zeros(4, 3)) for _ in range(2)]
    buf = _buffer(frozenset(params), params)
    buf.grad_data.fill_(float("nan"))  # a skipped step's leftovers
    buf.zero_grad()
    g = torch.randn(4, 3)
    accumulate_wgrad(params[0], g, fuse=True)
    dy, x = torch.randn(5, 4), torch.randn(5, 3)
    accumulate_wgrad_mm(params[1], dy, x)
    assert torch.equal(params[0].main_grad, g)  # 0 + g, not NaN + g
    torch.testing.assert_close(params[1].main_grad, dy.t() @ x)
    accumulate_wgrad(params[0], g, fuse=True)  # flag cleared: now it adds
    assert torch.equal(params[0].main_grad, 2 * g)


def test_a_flagged_grad_no_layer_wrote_this_step_is_reduced_as_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose loss does not reach the experts: their grads keep last step's values and flags; the bucket
    group's guard must zero them before the reduce, as the zero fill did (a mutant without it steps on them)."""
    from moectl.core.config.schema import MoEConfig, OptimizerConfig, ParallelConfig
    from trainer.engine.distributed import DistributedEngine
    from trainer.moe.experts import GroupedMLP

    def run(stale: str) -> tuple[list[float], torch.Tensor]:
        monkeypatch.setenv("MOECTL_STALE_GRADS", stale)
        torch.manual_seed(0)
        model = torch.nn.Module()
        model.experts = GroupedMLP(MoEConfig(num_experts=2, ffn_hidden_size=8, backend="fused"), 8,
                                   generator=torch.Generator().manual_seed(0), gradient_accumulation_fusion=True)
        model.dense = torch.nn.Linear(8, 8)
        engine = DistributedEngine(model, ParallelConfig(), OptimizerConfig(lr=1e-2), ParallelState.trivial())
        x, norms = torch.randn(6, 8), []
        for use_experts in (True, False):
            engine.zero_grad()
            y = model.dense(x)
            if use_experts:
                y = y + model.experts(x, torch.tensor([3, 3]), None)
            y.square().sum().backward()
            norms.append(engine.step(1e-2).grad_norm)
        engine.sync_params_for_eval()
        return norms, model.experts.linear_fc1.weight.detach().clone()

    norms, weight = run("1")
    ref_norms, ref_weight = run("0")
    assert norms == ref_norms
    assert torch.equal(weight, ref_weight)


def _train(tmp_path: Path, name: str, extra: list[str]) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    cfg = load_config("configs/tiny.yaml", [*BASE, *extra, f"run_dir={tmp_path / name}"])
    trainer = Trainer(cfg, SilentObserver())
    losses = [float(trainer.train_step(step)["loss"]) for step in range(4)]
    trainer.engine.sync_params_for_eval()
    model = trainer.model
    flagged = [n for n, p in model.named_parameters() if stale_flag(p) is not None]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, flagged


@pytest.mark.parametrize("layout", ["true", "false"], ids=["grouped", "per-expert"])
def test_training_with_stale_expert_grads_is_bitwise_the_zero_filled_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    extra = [f"moe.single_grouped_weight={layout}"]
    losses, params, flagged = _train(tmp_path, "stale", extra)
    # the test is about something: every expert weight was flagged, nothing else was
    assert flagged and all(".experts." in n and ".weight" in n for n in flagged), flagged
    assert len(flagged) == 2 * 2 * (1 if layout == "true" else 4)  # layers x (fc1, fc2) x weights each
    monkeypatch.setenv("MOECTL_STALE_GRADS", "0")
    ref_losses, ref_params, ref_flagged = _train(tmp_path, "filled", extra)
    assert not ref_flagged
    assert losses == ref_losses
    for n, p in params.items():
        assert torch.equal(p, ref_params[n]), n


def test_a_recipe_or_an_unfused_layer_keeps_every_grad_zero_filled(tmp_path: Path) -> None:
    _, _, flagged = _train(tmp_path, "grouped", ["moe.backend=grouped"])
    assert flagged == []
    _, _, flagged = _train(tmp_path, "unfused", ["parallel.gradient_accumulation_fusion=false"])
    assert flagged == []



def _two_rank_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from trainer.runtime import setup_runtime

    out: dict[str, Any] = {}
    for name, extra in (("dp2_overlap", ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"]),
                        ("ep2", ["parallel.expert_model_parallel_size=2", "parallel.overlap_grad_reduce=true"])):
        for stale in ("1", "0"):
            os.environ["MOECTL_STALE_GRADS"] = stale
            cfg = load_config("configs/tiny.yaml", [*BASE, *extra, "train.global_batch_size=8",
                                                    f"run_dir={root}/{name}-{stale}"])
            trainer = Trainer(cfg, SilentObserver(), runtime=setup_runtime(cfg.train, cfg.parallel))
            losses = [float(trainer.train_step(step)["loss"]) for step in range(3)]
            trainer.engine.sync_params_for_eval()
            out[f"{name}-{stale}"] = (
                losses,
                {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                sum(stale_flag(p) is not None for p in trainer.model.parameters()),
            )
    # compared here: tensors do not cross the result queue
    summary: dict[str, Any] = {}
    for name in ("dp2_overlap", "ep2"):
        (losses, params, flagged), (ref_losses, ref_params, ref_flagged) = out[f"{name}-1"], out[f"{name}-0"]
        summary[name] = {"flagged": (flagged, ref_flagged), "losses": (losses, ref_losses),
                         "unequal": [n for n, p in params.items() if not torch.equal(p, ref_params[n])]}
    return summary


@pytest.mark.slow
def test_two_ranks_with_stale_expert_grads_are_bitwise_the_zero_filled_runs(tmp_path: Path) -> None:
    """dp=2 with overlapped reduce-scatter (grads read by the reduce right after the last micro-batch) and
    ep=2 (expert grads in the expert-dp buffer): stale flags on vs off, every rank, bitwise."""
    for rank, result in enumerate(run_distributed(_two_rank_body, world_size=2, timeout=240, root=str(tmp_path))):
        for name, r in result.items():
            flagged, ref_flagged = r["flagged"]
            assert flagged > 0 and ref_flagged == 0, (rank, name, r)
            assert r["losses"][0] == r["losses"][1], (rank, name, r)
            assert r["unequal"] == [], (rank, name, r)
