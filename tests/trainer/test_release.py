"""A dropped Trainer frees its model: nothing the engine hooks into the model keeps it alive. Params and
expert modules are also held from C++ (the autograd graph the last forward's aux losses keep), where Python's
garbage collector does not look, so a strong reference from their hooks back to the engine made a cycle
that was never freed; `moectl bench train` builds one Trainer per column and would run out of memory."""

from __future__ import annotations

import gc
import weakref

import pytest

from moectl.core.config.load import load_config
from trainer.loop import Trainer
from trainer.observer import SilentObserver

SMALL = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
         "model.seq_length=32", "moe.num_experts=4", "moe.ffn_hidden_size=32", "train.micro_batch_size=2",
         "train.global_batch_size=4", "train.eval_interval=null", "data.source=synthetic"]  # fmt: skip
FP8_GATHER = ["mixed_precision.bf16=true", "mixed_precision.fp8=e4m3", "mixed_precision.fp8_param_gather=true"]


def _trained(*extra: str) -> weakref.ref:
    t = Trainer(load_config(None, [*SMALL, *extra]), SilentObserver())
    t.train_step(0)
    return weakref.ref(t.model)


@pytest.mark.parametrize(
    "extra",
    [[], ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"], FP8_GATHER],
    ids=["distributed-optimizer", "overlap", "fp8-param-gather"],
)
def test_a_dropped_trainer_frees_its_model(extra):
    model = _trained(*extra)
    gc.collect()
    assert model() is None
