"""Param gather through the real `Trainer` (config -> build -> loop -> checkpoints), one process.

- mxfp8 (reuse buffer), fp8 tensorwise and fp8 blockwise: the run trains with quantized weights (the model holds no
  high-precision copy) and reaches the same losses as without param gather (evals every step);
- the checkpoint holds, under a quantized param's name, its master cast to the param dtype (never a
  placeholder, never quantized bytes), and fp32 masters for everything; `ckpt validate` passes, its param
  check proving each live quantized weight is the recipe's quantization of its master;
- resume is exact: 4 steps straight equal 2 steps + save + a fresh Trainer + 2 steps (losses, masters).
"""

from __future__ import annotations

from pathlib import Path


import pytest
import torch
from trainer.observer import SilentObserver

from ckpt import open_checkpoint
from trainer.validation import validate_checkpoint
from moectl.core.config.load import load_config
from trainer.distributed.quantized_storage import quantized_storage_of
from trainer.loop import Trainer

FAST = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=16", "model.ffn_hidden_size=32", "model.moe_layer_freq=[1,0]", "moe.num_experts=4",
    "moe.ffn_hidden_size=32", "moe.backend=grouped", "train.micro_batch_size=2", "train.global_batch_size=4",
    "data.source=synthetic", "train.eval_interval=1", "train.eval_iters=1", "optimizer.lr_warmup_iters=0",
    "mixed_precision.bf16=true", "mixed_precision.fp8=e4m3", "logging.jsonl=false", "train.device=cpu",
]
RECIPES = {
    "mxfp8": ["mixed_precision.fp8_recipe=mxfp8", "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true"],
    "tensorwise": ["mixed_precision.fp8_recipe=tensorwise"],
    # 128x128 weight blocks: GEMM dims in multiples of 128 (rule MOE006)
    "blockwise": ["mixed_precision.fp8_recipe=blockwise", "model.hidden_size=128", "model.ffn_hidden_size=128",
                  "moe.ffn_hidden_size=128"],
}
GATHER = ["mixed_precision.fp8_param_gather=true"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def trainer(run_dir: Path, *extra: str) -> Trainer:
    return Trainer(load_config(None, [*FAST, f"run_dir={run_dir}", *extra]), SilentObserver())


def masters(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: e["master"] for n, e in t.engine.optimizer.gather_logical_state()["params"].items()}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_trainer_param_gather_checkpoint_validate_resume(tmp_path: Path, recipe: str) -> None:
    rec = RECIPES[recipe]
    off = trainer(tmp_path / "off", *rec, "train.train_iters=4")
    off_result = off.run()
    straight = trainer(tmp_path / "on", *rec, *GATHER, "train.train_iters=4", "checkpoint.save_interval=2")
    on_result = straight.run()
    quantized = [n for n, p in straight.model.named_parameters() if quantized_storage_of(p) is not None]
    assert len(quantized) == 8, quantized
    # Same losses as without param gather (bitwise here: one micro-batch per rank and step; the global grad
    # norm's summation order differs with the buffer split, and shows only when clipping engages).
    assert on_result.losses == pytest.approx(off_result.losses, rel=1e-6, abs=0)
    assert [v for _, v in on_result.eval_losses] == pytest.approx([v for _, v in off_result.eval_losses], rel=1e-6)

    ck = open_checkpoint(tmp_path / "on" / "checkpoints" / "step_00000004")
    final = masters(straight)
    params = dict(straight.model.named_parameters())
    for name in quantized:
        saved = ck.read(name)
        assert saved.dtype == torch.bfloat16 and torch.equal(saved, final[name].to(torch.bfloat16)), name
        assert torch.equal(ck.read(name + ".main_param"), final[name]), name
    assert not any(params[n].isfinite().any() for n in quantized)  # the live params are placeholders

    report = validate_checkpoint(ck.path)
    assert report.ok, report.failures()
    checked = [c for c in report.checks if c.stage == "param" and c.name in quantized]
    assert len(checked) == len(quantized) and all(c.ok for c in checked)
    saved = [c for c in report.checks if c.stage == "weight" and c.name in quantized]  # the bf16 cast saved for them
    assert len(saved) == len(quantized) and all(c.ok for c in saved)

    resumed = trainer(tmp_path / "on", *rec, *GATHER, "train.train_iters=4",
                      "checkpoint.load=" + str(tmp_path / "on" / "checkpoints" / "step_00000002"))  # fmt: skip
    again = resumed.run()
    assert again.losses == on_result.losses[2:]
    got = masters(resumed)
    assert all(torch.equal(got[n], final[n]) for n in final)
