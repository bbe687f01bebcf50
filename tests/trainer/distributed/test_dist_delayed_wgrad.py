"""`moe.delay_wgrad_compute` in whole runs on two gloo ranks: `moectl parity`'s comparison, bitwise.

One spawn; for each case the Trainer runs OFF (delay off) and ON (delay on) in lockstep (`trainer.parity`)
and every step's loss, grad norm, params, masters and Adam moments must be bitwise equal:
- dp 2, overlap_grad_reduce on, two micro-batches, fused grad accumulation off (the grads go through
  `.grad` and the buffer's post-accumulate hooks): the delayed grads must still launch their buckets, or
  `finish_grad_sync` refuses the step (seed 004);
- ep 2 with the all-to-all dispatcher (and overlap_grad_reduce, fused accumulation): the weight grads are
  computed while the all-to-all of the data grads is in flight: each flush runs between the async launch
  of an all-to-all and its wait;
- ep 2 with the all-gather dispatcher (around the async reduce-scatter), bf16 with fp8 tensorwise experts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from dist_helpers import run_distributed
from moectl.core.config.load import load_config
from trainer.moe import delayed_wgrad
from trainer.parity import run_parity

BASE = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=16", "moe.num_experts=4", "moe.ffn_hidden_size=16", "train.micro_batch_size=2",
    "train.global_batch_size=8", "data.source=synthetic", "train.eval_interval=null", "train.train_iters=3",
    "train.device=cpu", "optimizer.lr_warmup_iters=0", "parallel.overlap_grad_reduce=true",
]  # fmt: skip
CASES = {
    "dp2-unfused": ["parallel.gradient_accumulation_fusion=false"],
    "ep2-alltoall": ["parallel.expert_model_parallel_size=2", "parallel.gradient_accumulation_fusion=true"],
    "ep2-allgather-fp8": ["parallel.expert_model_parallel_size=2", "moe.token_dispatcher=allgather",
                          "mixed_precision.bf16=true", "mixed_precision.fp8=e4m3", "moe.backend=grouped",
                          "model.hidden_size=64", "moe.ffn_hidden_size=32"],
}  # fmt: skip


def _body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    events: list[Any] = []
    real_a2a, real_flush = dist.all_to_all_single, delayed_wgrad.DelayedWgrad.flush

    class Work:
        def __init__(self, work: Any) -> None:
            self.work = work

        def wait(self) -> Any:
            events.append("wait")
            return self.work.wait()

    def a2a(*args: Any, async_op: bool = False, **kw: Any) -> Any:
        events.append(("a2a", async_op))
        out = real_a2a(*args, async_op=async_op, **kw)
        return Work(out) if async_op else out

    def flush(self: Any) -> None:
        if self.pending:
            events.append("flush")
        real_flush(self)

    dist.all_to_all_single = a2a  # this child only
    delayed_wgrad.DelayedWgrad.flush = flush
    out: dict[str, Any] = {}
    for name, extra in CASES.items():
        events.clear()
        off = load_config(None, [*BASE, *extra, f"run_dir={root}/{name}"])
        on = load_config(None, [*BASE, *extra, f"run_dir={root}/{name}", "moe.delay_wgrad_compute=true"])
        report = run_parity(off, on, 3)
        out[name] = {
            "differences": [d.describe() for r in report.records for d in r.differences][:5],
            "losses": [r.on.loss for r in report.records],
            "events": list(events),
        }
    return out


@pytest.mark.slow
def test_delayed_wgrad_runs_equal_undelayed_bitwise(tmp_path: Any) -> None:
    for rank, result in enumerate(run_distributed(_body, world_size=2, timeout=300, root=str(tmp_path))):
        for name, r in result.items():
            assert r["differences"] == [], (rank, name, r["differences"])
            assert len(r["losses"]) == 3, (rank, name)
        ev = result["ep2-alltoall"]["events"]
        flushes = [i for i, e in enumerate(ev) if e == "flush"]
        # 3 steps x 2 micro-batches x 2 MoE layers, each flushed inside its all-to-all's backward
        assert len(flushes) == 12, ev
        assert all(ev[i - 1] == ("a2a", True) and ev[i + 1] == "wait" for i in flushes), ev
        assert result["dp2-unfused"]["events"].count("flush") == 12
