"""Resume refusals of trainer/checkpointing/resume.py: another optimizer than the checkpoint's, and tensors the
checkpoint's own (re-sealed) config does not describe; each one line, never a traceback.

Resuming an Adam checkpoint with `optimizer.optimizer=sgd` dropped the Adam state without a word (exit 0); with
muon it failed on missing momentum buffers without saying the optimizer differs. A manifest whose config was
edited and re-sealed failed inside the optimizer (`ValueError: ... shape (64, 32) != param (96, 32)`), and one
whose `train_state.optimizer_step` is "abc" in `int()`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ckpt"))  # tests/ckpt's checkpoint builders
from moe_ckpt_fixtures import build_model, fake_optimizer, save_model_checkpoint, tiny_config  # noqa: E402

from ckpt.manifest import dumps  # noqa: E402
from ckpt.seal import seal  # noqa: E402
from moectl.cli.app import app  # noqa: E402
from moectl.core.config.load import load_config  # noqa: E402
from moectl.core.errors import CheckpointError, ConfigError  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.observer import SilentObserver  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# tiny_config's model (the checkpoint's), on synthetic data; the checkpoint is of step 7
TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.num_query_groups=2",
    "model.vocab_size=64", "model.seq_length=16", "moe.num_experts=4", "moe.router_topk=2", "moe.ffn_hidden_size=64",
    "moe.backend=loop", "data.source=synthetic", "train.micro_batch_size=2", "train.global_batch_size=4",
    "train.eval_interval=null", "optimizer.lr_warmup_iters=0", "train.train_iters=8", "logging.jsonl=false",
]  # fmt: skip


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """An Adam checkpoint (masters and both moments for every param) of a real model, and its model weights."""
    cfg = tiny_config()
    state = build_model(cfg).state_dict()
    return save_model_checkpoint(tmp_path / "ck", cfg, state, fake_optimizer(state)), state


def trainer(run_dir: Path, *extra: str) -> Trainer:
    return Trainer(load_config(None, [*TINY, f"run_dir={run_dir}", *extra]), SilentObserver())


def reseal(step: Path, path: str, value: Any) -> None:
    """Set one manifest field and recompute the digest, so only the field's own check can catch it."""
    m = json.loads((step / "manifest.json").read_text())
    *parents, leaf = path.split(".")
    node = m
    for p in parents:
        node = node[p]
    node[leaf] = value
    (step / "manifest.json").write_bytes(dumps(seal(m)))


@pytest.mark.parametrize("optimizer", ["sgd", "muon"])
def test_optimizer_state_of_another_optimizer_is_refused_naming_both(
    saved: tuple[Path, Any], tmp_path: Path, optimizer: str
) -> None:
    step, _ = saved
    with pytest.raises(ConfigError) as e:
        trainer(tmp_path / "run", f"optimizer.optimizer={optimizer}", f"checkpoint.load={step}")
    line = e.value.one_line()
    assert e.value.exit_code == 2 and "\n" not in line
    assert line.startswith(f"optimizer.optimizer='{optimizer}': checkpoint {step} holds the state of optimizer adam, "
                           f"not {optimizer}"), line  # fmt: skip
    assert f"fix: set checkpoint.no_load_optim=true to start {optimizer} fresh" in line
    assert "or optimizer.optimizer=adam to resume the checkpoint's optimizer" in line


@pytest.mark.parametrize("optimizer", ["sgd", "muon"])
def test_no_load_optim_starts_another_optimizer_from_the_checkpoints_weights(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, optimizer: str
) -> None:
    step, state = saved
    t = trainer(tmp_path / "run", f"optimizer.optimizer={optimizer}", f"checkpoint.load={step}",
                "checkpoint.no_load_optim=true")  # fmt: skip
    for name, p in t.model.named_parameters():
        assert torch.equal(p.detach().cpu(), state[name]), name
    losses = t.run().losses
    assert len(losses) == 1 and all(torch.isfinite(torch.tensor(losses)))  # step 8 of 8, from step 7


def test_a_checkpoint_that_records_no_optimizer_loads_as_before(saved: tuple[Path, Any], tmp_path: Path) -> None:
    step, _ = saved
    reseal(step, "config.optimizer", {})  # hand-made checkpoints may record no optimizer: nothing to compare
    assert trainer(tmp_path / "run", f"checkpoint.load={step}").engine.step_count == 7


def test_train_cli_refuses_another_optimizer_in_one_line_exit_2(saved: tuple[Path, Any], tmp_path: Path) -> None:
    step, _ = saved
    sets = [a for s in [*TINY, f"checkpoint.load={step}", "optimizer.optimizer=sgd"] for a in ("--set", s)]
    r = CliRunner().invoke(app, ["train", "configs/tiny.yaml", *sets, "--run-dir", str(tmp_path / "run")],
                           env={"MOECTL_DEBUG": ""})  # fmt: skip
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds the state of optimizer adam, not sgd" in errors[0], r.output
    assert "Traceback" not in r.output


def test_tensors_the_checkpoints_own_config_does_not_describe_are_named(
    saved: tuple[Path, Any], tmp_path: Path
) -> None:
    """A config edit that the manifest's cheap check (ckpt/config_fit.py) does not cover, attention's kv groups,
    meets the model's params here: linear_qkv is [(4 + 2*2) * 8, 32] saved, [(4 + 2*4) * 8, 32] built."""
    step, _ = saved
    reseal(step, "config.model.num_query_groups", 4)
    with pytest.raises(CheckpointError) as e:
        trainer(tmp_path / "run", f"checkpoint.load={step}", "model.num_query_groups=4")
    line = e.value.one_line()
    assert (f"checkpoint {step} tensor 'decoder.layers.0.self_attention.linear_qkv.weight.main_param' is [64, 32], "
            "but its recorded config builds decoder.layers.0.self_attention.linear_qkv.weight as [96, 32]") in line
    assert "\n" not in line


def test_a_resealed_optimizer_step_that_is_no_int_refuses_the_resume(saved: tuple[Path, Any], tmp_path: Path) -> None:
    step, _ = saved
    reseal(step, "train_state.optimizer_step", "abc")
    with pytest.raises(CheckpointError) as e:
        trainer(tmp_path / "run", f"checkpoint.load={step}")
    assert "train_state.optimizer_step must be a non-negative int, got 'abc'" in e.value.one_line()
