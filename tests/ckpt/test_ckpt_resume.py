"""Bitwise resume: N steps straight equals K steps + save + a fresh Trainer + N-K steps."""

import json

import pytest
import torch
from trainer.observer import SilentObserver

from ckpt import open_checkpoint
from moectl.core.config.load import load_config
from moectl.core.errors import CheckpointError
from trainer.loop import Trainer

FAST = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=32", "moe.num_experts=4", "moe.ffn_hidden_size=16", "train.micro_batch_size=2",
    "train.global_batch_size=4", "data.source=synthetic", "train.eval_interval=null", "optimizer.lr_warmup_iters=2", "optimizer.lr_decay_iters=8",
]


def trainer(run_dir, *extra) -> Trainer:
    return Trainer(load_config(None, [*FAST, f"run_dir={run_dir}", *extra]), SilentObserver())


def final_state(t: Trainer) -> dict[str, torch.Tensor]:
    state = t.engine.optimizer.gather_logical_state()
    out = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    for n, e in state["params"].items():
        for k, v in e.items():
            out[f"{n}.{k}"] = v
    out["step"] = torch.tensor(state["step"])
    return out


@pytest.mark.parametrize("layout_b", [True, False])
def test_resume_is_bitwise(tmp_path, layout_b):
    straight = trainer(tmp_path / "a", "train.train_iters=8")
    full = straight.run()
    first = trainer(tmp_path / "b", "train.train_iters=4", "checkpoint.save_interval=2", "checkpoint.keep_last=1")
    first.run()
    ckpts = sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step_*"))
    assert ckpts == ["step_00000004"]  # keep_last=1 retired step 2
    # Resume in a fresh Trainer; the second half may even use the other expert layout.
    second = trainer(tmp_path / "b", "train.train_iters=8", "checkpoint.load=" + str(tmp_path / "b" / "checkpoints"),
                     f"moe.single_grouped_weight={layout_b}")
    resumed = second.run()
    assert resumed.losses == full.losses[4:]  # exact floats
    if layout_b:  # same layout: params, masters, moments and step bit-identical
        a, b = final_state(straight), final_state(second)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, 9))  # resumed run appends


def test_checkpoint_manifest_records_the_run(tmp_path):
    t = trainer(tmp_path, "train.train_iters=2", "checkpoint.save_interval=2", "moe.glu_interleave_size=8")
    t.run()
    ck = open_checkpoint(tmp_path / "checkpoints")
    meta = ck.meta
    assert ck.step == 2 and meta["consumed_samples"] == 8
    assert meta["expert_layout"] == "single-grouped" and meta["glu_interleave_size"] == 8
    assert meta["probe"]["loss_hex"] == float(meta["probe"]["loss"]).hex()
    names = set(ck.tensor_names())
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight" in names
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight.main_param" in names
    assert "embedding.word_embeddings.weight.exp_avg_sq" in names
    assert ck.read("decoder.layers.0.mlp.experts.linear_fc1.weight.main_param").dtype == torch.float32


def test_load_refuses_another_architecture_naming_the_keys(tmp_path):
    trainer(tmp_path, "train.train_iters=1", "checkpoint.save_interval=1").run()
    with pytest.raises(CheckpointError, match=r"moe.num_experts: checkpoint 4, config 8"):
        trainer(tmp_path / "x", "train.train_iters=2", "moe.num_experts=8",
                "checkpoint.load=" + str(tmp_path / "checkpoints"))


def test_null_attention_sizes_and_their_values_written_out_are_one_model(tmp_path):
    """A user trial: resuming with `model.kv_channels` written out as the value null stands for was refused
    ("kv_channels: checkpoint None, config 16"); so was num_query_groups null against the heads. They resolve
    alike now; a real difference is still named, in YAML's words."""
    from ckpt.logical import check_architecture
    from moectl.core.config.load import load_config

    base = ["model.hidden_size=32", "model.num_attention_heads=2"]
    saved = load_config(None, [*base, "model.num_query_groups=null", "model.kv_channels=null"])
    saved_dict = {"model": vars(saved.model).copy(), "moe": vars(saved.moe).copy()}
    check_architecture(saved_dict, load_config(None, [*base, "model.num_query_groups=2", "model.kv_channels=16"]))
    with pytest.raises(CheckpointError, match=r"model.kv_channels: checkpoint null, config 8"):
        check_architecture(saved_dict, load_config(None, [*base, "model.kv_channels=8"]))
    with pytest.raises(CheckpointError, match=r"model.qk_layernorm: checkpoint false, config true"):
        check_architecture(saved_dict, load_config(None, [*base, "model.qk_layernorm=true"]))


def test_missing_load_path_is_an_error_not_a_random_init(tmp_path):
    with pytest.raises(CheckpointError):
        trainer(tmp_path, "train.train_iters=2", "checkpoint.load=" + str(tmp_path / "nope"))


def test_load_main_params_only_keeps_masters_and_resets_moments(tmp_path):
    t = trainer(tmp_path, "train.train_iters=3", "checkpoint.save_interval=3")
    t.run()
    masters = {n: e["master"] for n, e in t.engine.optimizer.gather_logical_state()["params"].items()}
    u = trainer(tmp_path / "u", "train.train_iters=5", "checkpoint.load=" + str(tmp_path / "checkpoints"),
                "checkpoint.no_load_optim=true", "checkpoint.load_main_params_from_ckpt=true")
    state = u.engine.optimizer.gather_logical_state()
    for n, e in state["params"].items():
        assert torch.equal(e["master"], masters[n]), n
        assert not e["exp_avg"].any(), n


def test_training_resumed_from_a_converted_checkpoint_equals_the_original_run(tmp_path):
    from ckpt.convert import convert_checkpoint

    full = trainer(tmp_path / "a", "train.train_iters=8").run()
    trainer(tmp_path / "b", "train.train_iters=4", "checkpoint.save_interval=4").run()
    convert_checkpoint(tmp_path / "b" / "checkpoints", tmp_path / "conv", "per-expert")
    assert open_checkpoint(tmp_path / "conv").meta["expert_layout"] == "per-expert"
    # The converted checkpoint's own layout (per-expert) and the original one both resume exactly.
    for single in (False, True):
        resumed = trainer(tmp_path / f"c{single}", "train.train_iters=8", f"moe.single_grouped_weight={single}",
                          "checkpoint.load=" + str(tmp_path / "conv")).run()
        assert resumed.losses == full.losses[4:]


def test_a_fresh_run_refuses_to_save_over_an_earlier_runs_checkpoints(tmp_path):
    from moectl.core.errors import MoectlError

    trainer(tmp_path, "train.train_iters=2", "checkpoint.save_interval=2").run()
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(MoectlError, match="already holds checkpoints") as e:
        trainer(tmp_path, "train.train_iters=2", "checkpoint.save_interval=2")
    assert "checkpoint.load=" in e.value.fix
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before  # nothing touched
