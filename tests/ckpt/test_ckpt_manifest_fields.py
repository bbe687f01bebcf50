"""A manifest edited and re-sealed (its digest recomputed as ckpt/seal.py does, so the digest holds) is still
checked where it is read (ckpt/manifest.py, ckpt/config_fit.py): a run-state counter that is not an int, or a
recorded config that contradicts the recorded tensor shapes, is one manifest problem naming the field, refused
by verify, open, `ckpt inspect`, `ckpt validate` and `ckpt convert`.

They crashed `ckpt validate` and resume (`ValueError: invalid literal for int() with base 10: 'abc'`;
`ValueError: output_layer.weight.master: shape (256, 64) != param (256, 128)`), and `ckpt convert` copied the
contradiction into a new checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
from moe_ckpt_fixtures import build_model, fake_optimizer, save_model_checkpoint, tiny_config
from typer.testing import CliRunner

from ckpt import open_checkpoint, verify_checkpoint
from ckpt import problems as P
from ckpt.config_fit import config_misfits
from ckpt.convert import convert_checkpoint
from ckpt.manifest import dumps
from ckpt.seal import seal
from moectl.cli.app import app
from moectl.core.config import config_to_dict
from moectl.core.errors import CheckpointError

runner = CliRunner()


@pytest.fixture()
def step(tmp_path: Path) -> Path:
    """A checkpoint of a real model (D 32, vocab 64, 2 layers, 4 experts of F 64) with Adam state."""
    cfg = tiny_config()
    state = build_model(cfg).state_dict()
    return save_model_checkpoint(tmp_path / "run", cfg, state, fake_optimizer(state))


def reseal(step: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the manifest and recompute its digest, as a tool that rewrites manifests would."""
    m = json.loads((step / "manifest.json").read_text())
    edit(m)
    (step / "manifest.json").write_bytes(dumps(seal(m)))


def put(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = m
        for p in parents:
            node = node[p]
        assert node[leaf] != value, path
        node[leaf] = value

    return edit


def _refused_everywhere(step: Path, says: str) -> None:
    problems = verify_checkpoint(step)
    assert [(p.kind, p.file) for p in problems] == [(P.MANIFEST, "manifest.json")], problems
    assert says in problems[0].message, problems[0].message
    for verify in (True, False):
        with pytest.raises(CheckpointError) as e:
            open_checkpoint(step, verify=verify)
        assert says in e.value.one_line() and "\n" not in e.value.one_line()


@pytest.mark.parametrize("value", ["abc", -1, 2.5, None])
def test_a_resealed_optimizer_step_that_is_no_count_is_refused(step: Path, value: Any) -> None:
    reseal(step, put("train_state.optimizer_step", value))
    _refused_everywhere(step, f"train_state.optimizer_step must be a non-negative int, got {value!r}")


# the edit -> what the problem says (the key, its value, the tensor and its recorded shape)
MISFITS = {
    "model.hidden_size": (128, "config model.hidden_size is 128, but tensor 'embedding.word_embeddings.weight' is "
                               "[64, 32] (32 in dim 1)"),
    "model.vocab_size": (256, "config model.vocab_size is 256, but tensor 'embedding.word_embeddings.weight' is "
                              "[64, 32] (64 in dim 0)"),
    "moe.num_experts": (8, "config moe.num_experts is 8, but tensor 'decoder.layers.0.mlp.router.weight' is [4, 32]"),
    "moe.ffn_hidden_size": (32, "config moe.ffn_hidden_size is 32, but tensor "
                                "'decoder.layers.0.mlp.experts.linear_fc2.weight' is [4, 32, 64] (64 in dim 2)"),
    "model.num_layers": (1, "config model.num_layers is 1, but tensor 'decoder.layers.1.input_layernorm.weight' is "
                            "of layer 1"),
}  # fmt: skip


@pytest.mark.parametrize("key", list(MISFITS))
def test_a_resealed_config_that_contradicts_the_tensors_is_refused_everywhere(
    step: Path, tmp_path: Path, key: str
) -> None:
    value, says = MISFITS[key]
    reseal(step, put(f"config.{key}", value))
    _refused_everywhere(step, says)
    with pytest.raises(CheckpointError, match="the recorded config does not describe the saved tensors"):
        convert_checkpoint(step, tmp_path / "out", "per-expert")
    assert not (tmp_path / "out").exists()  # nothing copied


@pytest.mark.parametrize("command", ["convert", "inspect", "validate"])
def test_the_cli_names_the_misfit_without_a_traceback(step: Path, tmp_path: Path, command: str) -> None:
    reseal(step, put("config.model.hidden_size", 128))
    args = ["ckpt", command, str(step)]
    if command == "convert":
        args += [str(tmp_path / "out"), "--layout", "per-expert"]
    r = runner.invoke(app, args, env={"COLUMNS": "400", "MOECTL_DEBUG": ""})
    assert r.exit_code == 1, r.output  # a bad checkpoint (validate: "invalid"), not bad usage
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    assert MISFITS["model.hidden_size"][1] in " ".join(r.output.split()), r.output
    if command != "validate":  # validate reports it as a failed integrity row of its table
        assert len(r.output.strip().splitlines()) == 1 and r.output.startswith("error: refusing to load"), r.output


def test_validate_of_a_resealed_optimizer_step_is_invalid_not_a_crash(step: Path) -> None:
    reseal(step, put("train_state.optimizer_step", "abc"))
    r = runner.invoke(app, ["ckpt", "validate", str(step)], env={"COLUMNS": "400", "MOECTL_DEBUG": ""})
    assert r.exit_code == 1, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "train_state.optimizer_step must be a non-negative int, got 'abc'" in r.output and "invalid" in r.output


CONFIGS = {
    "grouped": {},
    "per-expert, biases, squared_relu": {"moe": {"single_grouped_weight": False, "add_bias": True,
                                                 "activation": "squared_relu"}},
    "dense layer, tied, qk norm": {"model": {"moe_layer_freq": [0, 1], "tie_embeddings": True, "qk_layernorm": True}},
    "interleaved fc1": {"moe": {"glu_interleave_size": 16}},
}  # fmt: skip


@pytest.mark.parametrize("which", list(CONFIGS))
def test_a_models_own_tensors_fit_its_config(which: str) -> None:
    """No false alarm: every model's tensors (and their optimizer state) fit the config that built it."""
    cfg = tiny_config(**CONFIGS[which])
    state = build_model(cfg).state_dict()
    tensors = {n: {"shape": list(t.shape)} for n, t in {**state, **fake_optimizer(state)}.items()}
    assert config_misfits(config_to_dict(cfg), tensors) == []
    # and each key the check reads does catch an edit
    for section, key in (("model", "hidden_size"), ("model", "vocab_size"), ("moe", "num_experts"),
                         ("moe", "ffn_hidden_size")):  # fmt: skip
        edited = config_to_dict(cfg)
        edited[section][key] *= 2
        assert any(f"config {section}.{key} is" in m for m in config_misfits(edited, tensors)), (which, key)


# fields a resume, validate or inspect reads, re-sealed malformed -> what the problem says. Each was a traceback:
# `ValueError: both buffer length (0) and count (-1) must not be 0` (resume, validate: rng), `ValueError: could not
# convert string to float: 'x'` (validate: probe), `AttributeError: 'str' object has no attribute 'get'` (resume:
# a config section), `AttributeError: 'int' object has no attribute 'items'` (inspect: writer).
MALFORMED = {  # id: (path, value, what the problem says)
    "rng": ("rng", {"torch": "!!!"}, "rng.torch must be a base64 string, got '!!!'"),
    "rng-null": ("rng", {"torch": None}, "rng.torch must be a base64 string, got null"),  # a review: a TypeError
    "probe.loss": ("probe.loss", "x", "probe.loss must be a number, got 'x'"),
    "probe.loss_hex": ("probe.loss_hex", "0xq", "probe.loss_hex must be a float in hex (float.hex), got '0xq'"),
    "config.model": ("config.model", "x", "config.model must be a dict, got str"),
    "writer": ("writer", 7, "writer must be a dict, got int"),
}


@pytest.mark.parametrize("key", list(MALFORMED))
def test_a_resealed_field_that_a_load_reads_is_refused_everywhere(step: Path, key: str) -> None:
    path, value, says = MALFORMED[key]
    reseal(step, put(path, value))
    _refused_everywhere(step, says)


@pytest.mark.parametrize("command", ["inspect", "validate"])
@pytest.mark.parametrize("key", list(MALFORMED))
def test_the_cli_names_a_malformed_field_without_a_traceback(step: Path, key: str, command: str) -> None:
    path, value, says = MALFORMED[key]
    reseal(step, put(path, value))
    r = runner.invoke(app, ["ckpt", command, str(step)], env={"COLUMNS": "400", "MOECTL_DEBUG": ""})
    assert r.exit_code == 1, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output and says in " ".join(r.output.split()), r.output


def test_an_rng_state_of_another_size_is_a_checkpoint_error_not_a_crash() -> None:
    """Well-formed base64 of the wrong length passes the manifest check; restoring it names the key."""
    from ckpt.logical import restore_rng

    with pytest.raises(CheckpointError, match=r"rng\.torch is not a torch CPU RNG state"):
        restore_rng({"rng": {"torch": "AAAA"}})
    with pytest.raises(CheckpointError, match=r"rng\.torch is not a torch CPU RNG state"):
        restore_rng({"rng": {"torch": ""}})
    with pytest.raises(CheckpointError, match=r"rng\.torch is not a torch CPU RNG state"):
        restore_rng({"rng": {"torch": None}})
