"""Where does a micro-batch refuse CUDA-graph capture? Captures the forward alone, then forward + backward,
of the trainer's step after one eager step, and prints the full traceback of the first failure; under
anomaly mode (no NaN checks, no syncs) a failing backward node also shows the forward code that made it.

    PYTHONPATH=. python3 scripts/probes/graph_capture.py [--keep-eager-graphs] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import sys
import traceback

import torch

from moectl.core.config.load import load_config
from trainer.loop import Trainer
from trainer.observer import SilentObserver

BASE = [
    "model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
    "model.seq_length=64", "model.vocab_size=256", "moe.num_experts=4", "moe.router_topk=2",
    "moe.ffn_hidden_size=128", "moe.capacity_factor=1.25", "moe.pad_expert_input_to_capacity=true",
    "train.micro_batch_size=2", "train.global_batch_size=6", "data.source=synthetic", "mixed_precision.bf16=true",
    "train.train_iters=4", "logging.jsonl=false", "run_dir=/tmp/graph-probe",
]  # fmt: skip


def main(sets: list[str]) -> int:
    t = Trainer(load_config(None, [*BASE, *sets]), SilentObserver())
    t.train_step(0)
    torch.cuda.synchronize()
    tokens, targets = t._step_batches(1)[0]
    t.engine.zero_grad()
    t.engine.sync_params_for_eval()
    if t.graph is not None:
        t.graph.refresh_weights()
        if "--keep-eager-graphs" not in sys.argv:
            t.graph.release_eager_graphs()
    for mode in ("forward", "forward+backward"):
        g = torch.cuda.CUDAGraph()
        try:
            with t.engine.micro_batch(is_last=False), torch.autograd.detect_anomaly(check_nan=False):
                with torch.cuda.graph(g):
                    parts = t.model.loss(tokens, targets)
                    if mode != "forward":
                        parts.total.backward()
            print(f"{mode}: captured", flush=True)
        except Exception:
            print(f"{mode}: FAILED", flush=True)
            traceback.print_exc()
            return 1
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main([a for a in sys.argv[1:] if a not in ("--set", "--keep-eager-graphs")]))
