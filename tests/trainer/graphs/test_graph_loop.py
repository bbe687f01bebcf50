"""The loop's graph path on the CPU, with an eager stand-in for the captured graph (no CUDA needed).

What the stand-in leaves to the loop is exactly what a real graph leaves to it: zeroing the grads, finishing
the param gather and refreshing the pinned weights before the step, running every micro-batch under
`no_sync`, launching the grad reduction after the last one, and the optimizer step. So a run through it must
equal the eager loop bit for bit, on one rank and on two gloo ranks with overlapped grad reduce and param
gather (where a forgotten `start_grad_sync` is an error, and a reduction launched from inside a micro-batch
would be double counted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import trainer.loop as loop_module
from dist_helpers import run_distributed
from moectl.core.config.load import load_config
from trainer.graphs.capture import ReplayedLoss
from trainer.loop import Trainer
from trainer.observer import SilentObserver

BASE = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=32", "model.vocab_size=256", "moe.num_experts=4", "moe.ffn_hidden_size=16",
    "moe.capacity_factor=1.25", "moe.pad_expert_input_to_capacity=true", "train.micro_batch_size=2",
    "data.source=synthetic", "optimizer.lr_warmup_iters=0", "optimizer.lr=1e-3", "train.train_iters=4",
    "train.eval_interval=2", "train.eval_iters=1", "logging.jsonl=false", "train.cpu_threads=1",
]  # fmt: skip


class EagerStandIn:
    """`MicroBatchGraph`'s interface, run eagerly: forward, loss / n_micro, backward, per call."""

    def __init__(self, model: torch.nn.Module, loss_fn: Any, n_micro: int) -> None:
        self.loss_fn, self.n_micro = loss_fn, n_micro
        self.refreshes = self.replays = 0

    def refresh_weights(self) -> None:
        self.refreshes += 1

    def run(self, tokens: torch.Tensor, targets: torch.Tensor) -> ReplayedLoss:
        parts = self.loss_fn(tokens, targets)
        (parts.total / self.n_micro).backward()
        self.replays += 1
        return ReplayedLoss(parts.lm_loss.detach(), parts.aux_loss.detach())


def _run(sets: list[str], run_dir: Path, graphs: bool, monkeypatch: Any = None) -> dict[str, Any]:
    if graphs:
        patch = monkeypatch.setattr if monkeypatch is not None else _setattr
        patch(loop_module, "wants_cuda_graph", lambda cfg, device: True)
        patch(loop_module, "MicroBatchGraph", EagerStandIn)
    cfg = load_config(None, [*BASE, *sets, f"run_dir={run_dir}"])
    trainer = Trainer(cfg, SilentObserver())
    result = trainer.run()
    trainer.engine.sync_params_for_eval()
    graph = trainer.graph
    return {
        "losses": result.losses, "evals": result.eval_losses,
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "replays": 0 if graph is None else graph.replays, "refreshes": 0 if graph is None else graph.refreshes,
    }  # fmt: skip


def _setattr(obj: Any, name: str, value: Any) -> None:
    setattr(obj, name, value)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["losses"] == b["losses"] and a["evals"] == b["evals"]
            and all(torch.equal(p, b["params"][n]) for n, p in a["params"].items()))  # fmt: skip


def test_the_graph_path_of_the_loop_equals_eager_on_one_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sets = ["train.global_batch_size=6"]
    eager = _run(sets, tmp_path / "eager", graphs=False)
    graph = _run(sets, tmp_path / "graph", graphs=True, monkeypatch=monkeypatch)
    assert graph["replays"] == 3 * 3 and graph["refreshes"] == 3  # steps 2-4; step 1 eager
    assert _same(eager, graph)


def _two_rank_body(rank: int, world_size: int, root: str) -> dict[str, bool | int]:
    sets = ["train.global_batch_size=12", "parallel.use_distributed_optimizer=true",
            "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"]  # fmt: skip
    eager = _run(sets, Path(root) / f"eager{rank}", graphs=False)
    graph = _run(sets, Path(root) / f"graph{rank}", graphs=True)
    return {"same": _same(eager, graph), "replays": graph["replays"]}


@pytest.mark.slow
def test_the_graph_path_of_the_loop_equals_eager_on_two_ranks_with_overlap(tmp_path: Path) -> None:
    for r in run_distributed(_two_rank_body, world_size=2, timeout=240, root=str(tmp_path)):
        assert r == {"same": True, "replays": 9}, r
