"""The doors a checkpoint loads through, each checked where a plausible bug would slip by:

- the trainer's load path re-interleaves fc1 from the checkpoint's own `glu_interleave_size` (a loader that
  read the config's instead would load gate/up rows swapped, and only a run of another interleave shows it);
- more than 10 experts stack by expert index, not by name (`weight10` sorts before `weight2`);
- `checkpoint.load_main_params_from_ckpt` takes the fp32 masters (in bf16, where they differ from the saved
  bf16 weights: in fp32 the two are equal and the key could be ignored unseen).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ckpt import open_checkpoint
from ckpt.layout import reinterleave_fc1, to_single_grouped
from moectl.core.config.load import load_config
from trainer.loop import Trainer
from trainer.observer import SilentObserver

FAST = [
    "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=16", "moe.ffn_hidden_size=16", "train.micro_batch_size=2", "train.global_batch_size=4",
    "data.source=synthetic", "train.eval_interval=null", "optimizer.lr_warmup_iters=0", "optimizer.lr_decay_iters=8",
    "train.device=cpu", "logging.jsonl=false",
]  # fmt: skip
FC1 = "decoder.layers.0.mlp.experts.linear_fc1.weight"


def trainer(run_dir: Path, *extra: str) -> Trainer:
    return Trainer(load_config(None, [*FAST, f"run_dir={run_dir}", *extra]), SilentObserver())


def masters(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: e["master"] for n, e in t.engine.logical_state().items()}


def test_trainer_load_reinterleaves_from_the_checkpoints_interleave(tmp_path: Path) -> None:
    """Saved with interleave 8, resumed with none: fc1 rows are reordered from 8 (the checkpoint's), and the
    resumed run continues the interleave-8 run exactly (the interleave is a row order, not other math)."""
    straight = trainer(tmp_path / "a", "moe.glu_interleave_size=8", "train.train_iters=4").run()
    trainer(tmp_path / "b", "moe.glu_interleave_size=8", "train.train_iters=2", "checkpoint.save_interval=2").run()
    ckpt = tmp_path / "b" / "checkpoints"
    saved = open_checkpoint(ckpt).read(FC1 + ".main_param")
    resumed = trainer(tmp_path / "c", "moe.glu_interleave_size=null", "train.train_iters=4", f"checkpoint.load={ckpt}")
    got = masters(resumed)[FC1]
    assert torch.equal(got, reinterleave_fc1(saved, 8, None, 16, dim=1))
    assert not torch.equal(got, saved)  # the two row orders differ, so the check above can fail
    assert resumed.run().losses == straight.losses[2:]


def test_more_than_ten_experts_stack_by_index_not_by_name() -> None:
    """`weight10` sorts before `weight2` by name; the stack must put expert e at index e."""
    E = 12
    members = {f"x.experts.linear_fc1.weight{e}.exp_avg": torch.full((2, 3), float(e)) for e in range(E)}
    stacked = to_single_grouped(members, E)["x.experts.linear_fc1.weight.exp_avg"]
    assert [int(v) for v in stacked[:, 0, 0]] == list(range(E))


def test_twelve_expert_per_expert_checkpoint_resumes_into_the_grouped_layout(tmp_path: Path) -> None:
    """The trainer's load path with 12 experts, per-expert -> single grouped: every expert's master, moments
    and weight land in its own slot, and training continues as the per-expert run does."""
    twelve = ["moe.num_experts=12", "moe.router_topk=2"]
    straight = trainer(tmp_path / "a", *twelve, "moe.single_grouped_weight=false", "train.train_iters=3").run()
    trainer(tmp_path / "b", *twelve, "moe.single_grouped_weight=false", "train.train_iters=2",
            "checkpoint.save_interval=2").run()  # fmt: skip
    ckpt = open_checkpoint(tmp_path / "b" / "checkpoints")
    resumed = trainer(tmp_path / "c", *twelve, "moe.single_grouped_weight=true", "train.train_iters=3",
                      f"checkpoint.load={ckpt.path}")  # fmt: skip
    state = resumed.engine.logical_state()[FC1]
    for key, suffix in (("master", ".main_param"), ("exp_avg", ".exp_avg"), ("exp_avg_sq", ".exp_avg_sq")):
        for e in range(12):
            assert torch.equal(state[key][e], ckpt.read(f"{FC1}{e}{suffix}")), (key, e)
    assert resumed.run().losses == straight.losses[2:]


def test_load_main_params_from_ckpt_takes_the_fp32_masters_in_bf16(tmp_path: Path) -> None:
    """bf16 params: the checkpoint's fp32 masters are not its bf16 weights upcast; with
    `load_main_params_from_ckpt` the masters come from the former, without it from the latter (Megatron's
    `no_load_optim` rule), and the moments start at zero either way."""
    bf16 = ["mixed_precision.bf16=true", "moe.backend=grouped"]
    trainer(tmp_path / "a", *bf16, "train.train_iters=3", "checkpoint.save_interval=3").run()
    ck = open_checkpoint(tmp_path / "a" / "checkpoints")
    load = [*bf16, "train.train_iters=5", f"checkpoint.load={ck.path}", "checkpoint.no_load_optim=true"]
    with_masters = trainer(tmp_path / "b", *load, "checkpoint.load_main_params_from_ckpt=true")
    from_weights = trainer(tmp_path / "c", *load, "checkpoint.load_main_params_from_ckpt=false")
    differs = 0
    for name, entry in with_masters.engine.logical_state().items():
        saved_master, saved_weight = ck.read(name + ".main_param"), ck.read(name)
        assert saved_master.dtype == torch.float32, name  # weights are bf16 (the router's stays fp32)
        assert torch.equal(entry["master"], saved_master), name
        assert torch.equal(from_weights.engine.logical_state()[name]["master"], saved_weight.float()), name
        assert not entry["exp_avg"].any(), name
        differs += not torch.equal(saved_master, saved_weight.float())
    assert differs > 5  # bf16 weights are not their masters: the test can tell the two sources apart
