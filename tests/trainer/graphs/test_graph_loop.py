"""The loop's graph path on the CPU, with an eager stand-in for the captured graph (no CUDA needed).

What the stand-in leaves to the loop is exactly what a real graph leaves to it: zeroing the grads, finishing
the param gather and refreshing the pinned weights before the step, running every micro-batch but the last
under `no_sync`, the last one's grad reductions inside its graph (data parallel: recorded by the loop after
each replay, since no hook runs in one) or launched after it (`MOECTL_GRAPH_GRAD_SYNC=0`), and the optimizer
step. So a run through it must equal the eager loop bit for bit, on one rank and on two gloo ranks with and
without overlapped grad reduce and param gather (where a reduction left unrecorded or unlaunched is an error
or launched twice, and a reduction launched from inside another micro-batch would be double counted).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

import trainer.loop as loop_module
from trainer import grad_sq
from trainer.moe import wgrad_deferral
from dist_helpers import run_distributed
from moectl.core.config.load import load_config
from trainer.distributed.bucket_group import GradSyncState
from trainer.distributed.param_sync import SETTLED, ParamSyncState
from trainer.parallel import comm
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
    """`MicroBatchGraph`'s interface, run eagerly: forward, loss / n_micro, backward (then `finish`), per call.

    A real replay runs the captured device work and no Python. The stand-in's later calls of a variant do
    the same: the gathers of a gathering variant, then the micro-batch with the pre-hooks and the grad hooks
    recording nothing, then (`finish`) each group's reduce with its state put back; so the loop must stage,
    mark and record everything itself. A variant without gathers must find every group settled, as the
    graph assumes (it holds no gather)."""

    engine: Any = None  # the run's engine, set by `_run` once the trainer exists

    def __init__(self, model: torch.nn.Module, loss_fn: Any, n_micro: int) -> None:
        self.loss_fn, self.n_micro = loss_fn, n_micro
        self.refreshes = self.replays = self.finishes = self.gathers = self.final_sq = self.deferred = 0
        self.captured: set[tuple[Any, ...]] = set()

    def refresh_weights(self) -> None:
        self.refreshes += 1

    def run(self, tokens: torch.Tensor, targets: torch.Tensor, gathers: bool = False,
            finish: Any = None, final_sq: bool = False, wgrad_defer: Any = None, micro: int = 0) -> ReplayedLoss:
        key = (gathers, finish is not None, final_sq, wgrad_defer, micro if wgrad_defer is not None else None)
        self.final_sq += final_sq
        self.deferred += bool(wgrad_defer)
        # a replay rewrites the partials its capture recorded, and keeps or reads the deferred wgrad operands
        with grad_sq.final_accumulation(final_sq), wgrad_deferral.micro_batch_phase(wgrad_defer):
            return self._run(key, tokens, targets, gathers, finish)

    def _run(self, key: tuple[Any, ...], tokens: torch.Tensor, targets: torch.Tensor, gathers: bool,
             finish: Any) -> ReplayedLoss:
        replay = key in self.captured
        self.captured.add(key)
        self.replays += 1
        self.gathers += gathers
        self.finishes += finish is not None
        dmodel = getattr(self.engine, "dmodel", None)
        if not replay or dmodel is None:  # the capture: Python runs (hooks, finish)
            parts = self.loss_fn(tokens, targets)
            (parts.total / self.n_micro).backward()
            if finish is not None:
                finish()
            return ReplayedLoss(parts.lm_loss.detach(), parts.aux_loss.detach())
        groups = dmodel.bucket_groups
        if not gathers:
            unsettled = [g.name for g in groups if g.state not in SETTLED]
            assert not unsettled, f"a graph without gathers replayed over pending gathers: {unsettled[:2]}"
        states = [g.sync.state for g in groups]
        if gathers:
            for g in groups:
                for output, input in g.gather_pairs() if g.needs_gather else []:
                    comm.all_gather(output, input, g.group)
        for g in groups:  # the pre-hooks ran at capture only
            g.sync.state = ParamSyncState.POST_PROCESSED
        with dmodel.no_sync():  # the grad hooks count nothing
            parts = self.loss_fn(tokens, targets)
            (parts.total / self.n_micro).backward()
        for g, state in zip(groups, states):
            g.sync.state = state
        if finish is not None:
            for g in groups:
                g.finish_grad_sync()
                g.grad_state = GradSyncState.ACCUMULATING  # what Python recorded: nothing
        return ReplayedLoss(parts.lm_loss.detach(), parts.aux_loss.detach())


def _run(sets: list[str], run_dir: Path, graphs: bool, monkeypatch: Any = None,
         inf_at_step: int | None = None) -> dict[str, Any]:
    """One run (`graphs`: through the stand-in, patched into the loop for this run only). `inf_at_step`: the
    last rank writes inf into its reduced grads before that step's update (0-based), after the reductions
    finished, so every rank skips it (`train.on_nonfinite=skip` in `sets`)."""
    if graphs and monkeypatch is None:
        with pytest.MonkeyPatch.context() as mp:
            return _run(sets, run_dir, graphs, mp, inf_at_step)
    if graphs:
        monkeypatch.setattr(loop_module, "wants_cuda_graph", lambda cfg, device: True)
        monkeypatch.setattr(loop_module, "MicroBatchGraph", EagerStandIn)
    cfg = load_config(None, [*BASE, *sets, f"run_dir={run_dir}"])
    trainer = Trainer(cfg, SilentObserver())
    if trainer.graph is not None:
        trainer.graph.engine = trainer.engine
    skipped: list[bool] = []
    if inf_at_step is not None:
        optimizer = trainer.engine.optimizer  # type: ignore[attr-defined]
        step, calls = optimizer.step, iter(range(10**6))

        def poisoned_step(lr: float, **kwargs: Any) -> Any:  # the engine calls it after finish_grad_sync
            if next(calls) == inf_at_step and trainer.rt.rank == trainer.rt.world_size - 1:
                for buf in trainer.engine.dmodel.buffers:  # type: ignore[attr-defined]
                    buf.grad_data.fill_(float("inf"))
            out = step(lr, **kwargs)
            skipped.append(out.skipped)
            return out

        optimizer.step = poisoned_step  # type: ignore[method-assign]
    result = trainer.run()
    trainer.engine.sync_params_for_eval()
    graph = trainer.graph
    return {
        "losses": result.losses, "evals": result.eval_losses,
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "replays": 0 if graph is None else graph.replays, "refreshes": 0 if graph is None else graph.refreshes,
        "finishes": 0 if graph is None else graph.finishes, "gathers": 0 if graph is None else graph.gathers,
        "final_sq": 0 if graph is None else graph.final_sq, "deferred": 0 if graph is None else graph.deferred,
        "skipped": skipped,
    }  # fmt: skip


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["losses"] == b["losses"] and a["evals"] == b["evals"]
            and all(torch.equal(p, b["params"][n]) for n, p in a["params"].items()))  # fmt: skip


@pytest.mark.parametrize("fused", [False, True, "defer"], ids=["grouped", "fused", "fused-deferred"])
def test_the_graph_path_of_the_loop_equals_eager_on_one_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             fused: Any) -> None:
    # fused: the expert wgrad leaves its sums of squares on the last micro-batch (trainer/grad_sq.py); deferred:
    # the last micro-batch's wgrad adds the earlier ones' (trainer/moe/wgrad_deferral.py)
    sets = ["train.global_batch_size=6"]
    if fused:
        sets += ["moe.backend=fused", "parallel.gradient_accumulation_fusion=true"]
    if fused == "defer":
        sets += ["moe.defer_expert_wgrad=true"]
    eager = _run(sets, tmp_path / "eager", graphs=False)
    graph = _run(sets, tmp_path / "graph", graphs=True, monkeypatch=monkeypatch)
    assert graph["replays"] == 3 * 3 and graph["refreshes"] == 3  # steps 2-4; step 1 eager
    assert graph["finishes"] == graph["gathers"] == 0  # one rank: nothing to reduce or gather
    assert graph["final_sq"] == 3  # each step's last micro-batch: a variant of its own
    assert graph["deferred"] == (3 * 2 if fused == "defer" else 0)  # 2 of each step's 3 micro-batches keep
    assert _same(eager, graph)


def _two_rank_body(rank: int, world_size: int, root: str, overlap: bool) -> dict[str, Any]:
    sets = ["train.global_batch_size=12", "parallel.use_distributed_optimizer=true",
            f"parallel.overlap_grad_reduce={overlap}", f"parallel.overlap_param_gather={overlap}"]  # fmt: skip
    eager = _run(sets, Path(root) / f"eager{rank}", graphs=False)
    graph = _run(sets, Path(root) / f"graph{rank}", graphs=True)
    out: dict[str, Any] = {"same": _same(eager, graph), "replays": graph["replays"], "finishes": graph["finishes"],
                           "gathers": graph["gathers"]}  # fmt: skip
    # a skipped update stages nothing: the next step's gathering graph re-stages the settled groups
    sets_skip = [*sets, "train.on_nonfinite=skip"]
    eager_skip = _run(sets_skip, Path(root) / f"eager-skip{rank}", graphs=False, inf_at_step=2)
    graph_skip = _run(sets_skip, Path(root) / f"graph-skip{rank}", graphs=True, inf_at_step=2)
    out["skip"] = (_same(eager_skip, graph_skip), graph_skip["skipped"], eager_skip["skipped"] == graph_skip["skipped"])
    out["eager_replays"] = eager["replays"] + eager_skip["replays"]  # the stand-in stays out of the eager runs
    if overlap:  # the A/B switches: one graph, the gather before the step and the reductions after it
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MOECTL_GRAPH_GRAD_SYNC", "0")
            mp.setenv("MOECTL_GRAPH_PARAM_GATHER", "0")
            after = _run(sets, Path(root) / f"after{rank}", graphs=True)
        out.update(same_after=_same(eager, after), collectives_after=after["finishes"] + after["gathers"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False])
def test_the_graph_path_of_the_loop_equals_eager_on_two_ranks(tmp_path: Path, overlap: bool) -> None:
    # steps 2-4, each with one last micro-batch; a first one that gathers where the gather overlaps
    want: dict[str, Any] = {"same": True, "replays": 9, "finishes": 3, "gathers": 3 if overlap else 0,
                            "skip": (True, [False, False, True, False], True), "eager_replays": 0}  # fmt: skip
    if overlap:
        want.update(same_after=True, collectives_after=0)
    for r in run_distributed(_two_rank_body, world_size=2, timeout=300, root=str(tmp_path), overlap=overlap):
        assert r == want, r
