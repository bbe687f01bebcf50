"""Delayed-scaling windows in a checkpoint written by 2 gloo ranks with expert parallelism (ep=2, dp=2 for the
dense layers): every rank gets back its own experts' windows exactly (gathered into global expert order on
save, sliced on load), and the dense layers' per-rank windows come back as their element-wise max (history)
and min (scale) over the ranks, on both. The grouped backend keeps one window per expert in one entry; the
per-expert loop one entry per expert, renumbered to global indices."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import run_distributed

from moectl.core.config.load import load_config
from trainer.checkpointing.scaling_state import local_entries
from trainer.loop import Trainer
from trainer.observer import SilentObserver

FAST = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=16", "model.ffn_hidden_size=32", "model.moe_layer_freq=[1,0]", "moe.num_experts=4",
    "moe.ffn_hidden_size=32", "train.micro_batch_size=2", "train.global_batch_size=4", "data.source=synthetic",
    "train.eval_interval=null", "optimizer.lr_warmup_iters=0", "mixed_precision.bf16=true",
    "mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=delayed", "logging.jsonl=false", "train.device=cpu",
    "parallel.expert_model_parallel_size=2", "train.train_iters=3",
]


def _as_bytes(t: Trainer) -> dict[str, tuple[list[int], bytes]]:
    return {f"{n}/{f}": (list(v.shape), v.numpy().tobytes()) for n, e in local_entries(t.model).items()
            for f, v in e.items()}  # fmt: skip


def _save_then_load(rank: int, world: int, root: str, backend: str) -> tuple[dict, dict, list[float]]:
    extra = [f"moe.backend={backend}", f"run_dir={root}"]
    t = Trainer(load_config(None, [*FAST, *extra]), SilentObserver())
    for step in range(2):
        t.train_step(step)
    t.save(2)
    before = _as_bytes(t)
    u = Trainer(load_config(None, [*FAST, *extra, f"checkpoint.load={root}/checkpoints"]), SilentObserver())
    after = _as_bytes(u)
    losses = u.run().losses  # and the run goes on from them
    return before, after, losses


def _tensor(shape_bytes: tuple[list[int], bytes]) -> torch.Tensor:
    shape, raw = shape_bytes
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["grouped", "loop"])
def test_expert_parallel_windows_come_back_to_their_ranks(tmp_path, backend: str) -> None:
    results = run_distributed(_save_then_load, root=str(tmp_path), backend=backend)
    (before0, after0, losses0), (before1, after1, losses1) = results
    assert len(losses0) == len(losses1) == 1 and all(torch.isfinite(torch.tensor(losses0 + losses1)))
    for before, after in ((before0, after0), (before1, after1)):
        assert before.keys() == after.keys() and before
    experts = [k for k in before0 if ".experts." in k]
    dense = [k for k in before0 if ".experts." not in k]
    assert experts and dense
    for k in experts:  # each rank's own experts (loop: local names; grouped: local columns), exactly
        assert after0[k] == before0[k] and after1[k] == before1[k], k
    assert any(before0[k] != before1[k] for k in experts)  # the ranks hold different experts' windows
    for k in dense:
        a, b = _tensor(before0[k]), _tensor(before1[k])
        want = torch.maximum(a, b) if k.endswith("/history") else torch.minimum(a, b)
        assert torch.equal(_tensor(after0[k]), want) and torch.equal(_tensor(after1[k]), want), k
    assert any(before0[k] != before1[k] for k in dense if k.endswith("/history"))  # the ranks saw other tokens
