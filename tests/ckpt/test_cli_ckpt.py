"""`moectl ckpt ...` through Typer's runner on the real app: exit codes, one-line errors, --json."""

from __future__ import annotations

import builtins
import errno
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from moe_ckpt_fixtures import assert_same_tensors, build_model, fake_optimizer, read_all, save_model_checkpoint, tiny_config
from typer.testing import CliRunner

from ckpt import hf as ckpt_hf
from ckpt.inspect import tensor_role
from moectl.cli.app import app

runner = CliRunner()


def invoke(*args: str):
    # a wide terminal keeps table cells on one line, so the asserts can look for whole names
    return runner.invoke(app, ["ckpt", *map(str, args)], env={"COLUMNS": "200", "MOECTL_DEBUG": ""})


@pytest.fixture()
def ckpt(tmp_path: Path) -> tuple[Path, dict]:
    cfg = tiny_config(moe={"router_norm_topk_prob": True})
    state = build_model(cfg).state_dict()
    tensors = {**state, **fake_optimizer(state)}
    save_model_checkpoint(tmp_path / "run", cfg, state, {n: t for n, t in tensors.items() if n not in state})
    return tmp_path / "run", tensors


def test_convert_round_trip_exits_0(ckpt: tuple[Path, dict], tmp_path: Path) -> None:
    root, tensors = ckpt
    r = invoke("convert", root, tmp_path / "per", "--layout", "per-expert")
    assert r.exit_code == 0, r.output
    assert "converted" in r.stdout and "step_00000007" in r.stdout
    r = invoke("convert", tmp_path / "per", tmp_path / "back", "--layout", "single-grouped")
    assert r.exit_code == 0, r.output
    assert_same_tensors(read_all(tmp_path / "back"), tensors)


def test_convert_errors_are_one_line_and_bad_arguments_exit_2(ckpt: tuple[Path, dict], tmp_path: Path) -> None:
    """A destination that exists, a source that does not and an interleave no checkpoint can take are the
    command's arguments: exit 2, as a bad option value (they were exit 1, what a bad checkpoint gets)."""
    root, _ = ckpt
    r = invoke("convert", root, root, "--layout", "per-expert")
    assert r.exit_code == 2
    assert r.output.startswith("error: destination") and "already exists. fix:" in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert invoke("convert", root, tmp_path / "x", "--layout", "grouped").exit_code == 2
    r = invoke("convert", root, tmp_path / "x", "--layout", "per-expert", "--glu-interleave-size", "abc")
    assert r.exit_code == 2 and "expected a positive int or none" in r.output
    r = invoke("convert", tmp_path / "nothing", tmp_path / "y", "--layout", "per-expert")
    assert r.exit_code == 2 and r.output.startswith("error:") and "does not exist" in r.output
    r = invoke("convert", root, tmp_path / "z", "--layout", "per-expert", "--glu-interleave-size", "7")
    assert r.exit_code == 2 and "must be a positive int dividing" in r.output
    r = invoke("validate", tmp_path / "nothing")
    assert r.exit_code == 2 and "does not exist" in r.output


def test_inspect_table_and_json(ckpt: tuple[Path, dict]) -> None:
    root, tensors = ckpt
    r = invoke("inspect", root)
    assert r.exit_code == 0, r.output
    for text in ("step_00000007", "448 samples consumed", "single-grouped", "dp 2, ep 1",
                 "decoder.layers.1.mlp.experts.linear_fc2.weight.exp_avg_sq", "4x32x64", "optim-00000"):  # fmt: skip
        assert text in r.stdout, text
    r = invoke("inspect", root / "step_00000007", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert (s["step"], s["consumed_samples"], s["expert_layout"], s["glu_interleave_size"]) == (7, 448, "single-grouped", None)
    assert s["probe"]["loss"] == 4.25 and s["problems"] is None and s["readable"] is True
    rows = {t["name"]: t for t in s["tensors"]}
    assert set(rows) == set(tensors)
    w = rows["decoder.layers.0.mlp.experts.linear_fc1.weight.main_param"]
    assert (w["dtype"], w["shape"], w["nbytes"], w["role"]) == ("float32", [4, 128, 32], 4 * 128 * 32 * 4, "main_param")
    assert s["totals"]["parameters"] == sum(t.numel() for n, t in tensors.items() if tensor_role(n) == "model")


def test_inspect_json_of_a_damaged_manifest_is_still_json(ckpt: tuple[Path, dict]) -> None:
    root, _ = ckpt
    (root / "step_00000007" / "manifest.json").write_text("{broken")
    r = invoke("inspect", root, "--json")
    assert r.exit_code == 1
    s = json.loads(r.stdout)
    assert s["readable"] is False and len(s["problems"]) == 1 and "manifest.json: not valid JSON" in s["problems"][0]
    r = invoke("inspect", root / "step_00000099", "--json")  # no such folder: exit 2, and still JSON
    assert r.exit_code == 2 and json.loads(r.stdout)["readable"] is False


def test_inspect_verify_exits_1_on_a_flipped_byte(ckpt: tuple[Path, dict]) -> None:
    root, _ = ckpt
    assert invoke("inspect", root, "--verify").exit_code == 0
    f = root / "step_00000007" / "optim-00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x01
    f.write_bytes(bytes(data))
    r = invoke("inspect", root, "--verify", "--json")
    assert r.exit_code == 1
    assert any("sha256" in p for p in json.loads(r.stdout)["problems"])


def test_import_hf_of_non_finite_weights_names_them_and_writes_nothing(ckpt: tuple[Path, dict], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    root, _ = ckpt
    assert invoke("export-hf", root, tmp_path / "hf", "--format", "mixtral").exit_code == 0
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        tensors = load_file(f)
        names = [n for n in tensors if n == "model.layers.0.input_layernorm.weight"]
        if names:
            tensors[names[0]].fill_(float("nan"))
            save_file(tensors, f, metadata={"format": "pt"})
    r = invoke("import-hf", tmp_path / "hf", tmp_path / "back")
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert "probe loss of nan (non-finite values in decoder.layers.0.input_layernorm.weight)" in r.output
    assert "JSON" not in r.output and not (tmp_path / "back").exists()


def test_export_and_import_hf(ckpt: tuple[Path, dict], tmp_path: Path) -> None:
    root, tensors = ckpt
    r = invoke("export-hf", root, tmp_path / "hf", "--format", "qwen3-moe")
    assert r.exit_code == 1 and "model.qk_layernorm=false" in r.output and len(r.output.strip().splitlines()) == 1
    r = invoke("export-hf", root, tmp_path / "hf", "--format", "mixtral")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "hf" / "config.json").is_file()
    # a --set that contradicts config.json is the command's fault, not the model's: usage (it was exit 1)
    r = invoke("import-hf", tmp_path / "hf", tmp_path / "back", "--set", "model.num_layers=3")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output, r.output
    assert "model.num_layers=3 (the HF model has 2)" in r.output
    assert "fix: drop model.num_layers from --set/--config" in r.output
    r = invoke("import-hf", tmp_path / "hf", tmp_path / "back", "--set", "train.train_iters=-5")
    assert r.exit_code == 2 and "MOE041" in r.output and "nothing imported" in r.output  # train would refuse it
    assert not (tmp_path / "back").exists()
    # what this machine lacks (Transformer Engine, a GPU) is for train to check on the machine that trains
    r = invoke("import-hf", tmp_path / "hf", tmp_path / "te", "--set", "moe.backend=te", "--no-probe")
    assert r.exit_code == 0 and "MOE022" not in r.output, r.output
    r = invoke("import-hf", tmp_path / "hf", tmp_path / "back", "--set", "train.seed=3")
    assert r.exit_code == 0, r.output
    assert f"config: {tmp_path / 'back' / 'config.yaml'}" in r.output.replace("\n", "")
    model = {n: t for n, t in tensors.items() if tensor_role(n) == "model"}
    assert_same_tensors(read_all(tmp_path / "back"), model)
    # a model-only checkpoint validates: weights, digests and the probe the import recorded
    r = invoke("validate", tmp_path / "back")
    assert r.exit_code == 0, r.output
    assert "model weights only" in r.output and "valid" in r.output and "weight" in r.output



def test_hf_arguments_that_name_nothing_usable_exit_2(ckpt: tuple[Path, dict], tmp_path: Path) -> None:
    """export-hf into a path under a file ended, after the export's work, in a traceback; import-hf from a folder
    without config.json exited 1 (export-hf's bad arguments exit 2). Both are one line, exit 2, now."""
    root, _ = ckpt
    (tmp_path / "afile").write_text("x")
    r = invoke("export-hf", root, tmp_path / "afile" / "out", "--format", "mixtral")
    assert r.exit_code == 2 and "is a file, not a folder" in r.output and "Traceback" not in r.output
    r = invoke("import-hf", tmp_path, tmp_path / "back")
    assert r.exit_code == 2 and "config.json not found" in r.output


def test_import_hf_of_a_model_file_it_may_not_read_says_permission_denied(
    ckpt: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It said the file was missing: safetensors reports any failure to open as "No such file or directory".
    Root reads a mode-000 file, so `open` and `safe_open` are made to fail as they do for an ordinary user."""
    root, _ = ckpt
    assert invoke("export-hf", root, tmp_path / "hf", "--format", "mixtral").exit_code == 0
    model = tmp_path / "hf" / "model.safetensors"
    real_open, real_safe_open = builtins.open, ckpt_hf.safe_open

    def refused(file: object) -> bool:
        return isinstance(file, (str, os.PathLike)) and os.path.abspath(file) == str(model)

    def fake_open(file: object, *args: object, **kwargs: object) -> object:
        if refused(file):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real_open(file, *args, **kwargs)

    def fake_safe_open(file: str, *args: object, **kwargs: object) -> object:
        if refused(file):  # safetensors 0.8's words for every failed open, without an errno
            raise FileNotFoundError(f"No such file or directory: {file}")
        return real_safe_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(ckpt_hf, "safe_open", fake_safe_open)
    r = invoke("import-hf", tmp_path / "hf", tmp_path / "back")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output, r.output
    assert r.output.startswith(f"error: {model}: cannot be read (Permission denied). fix: make it readable"), r.output
    assert "No such file" not in r.output and not (tmp_path / "back").exists()


@pytest.mark.parametrize("cmd", ["convert", "inspect", "export-hf", "import-hf"])
def test_every_command_has_examples(cmd: str) -> None:
    r = invoke(cmd, "--help")
    assert r.exit_code == 0 and "Examples:" in r.stdout and f"moectl ckpt {cmd}" in r.stdout


def test_validate_refuses_a_set_that_breaks_a_rule_with_the_rule_not_a_traceback(ckpt: tuple[Path, dict]) -> None:
    """`--set moe.router_topk=9` was a ValueError traceback from the router, `train.micro_batch_size=0` a
    ZeroDivisionError: train's rules run on the config to validate with first (exit 2: the command's fault)."""
    root, _ = ckpt
    for setting, rule in (("moe.router_topk=9", "MOE018"), ("train.micro_batch_size=0", "MOE041")):
        r = invoke("validate", root, "--set", setting)
        assert r.exit_code == 2, r.output
        lines = r.output.strip().splitlines()
        assert "Traceback" not in r.output and f"error: {rule} " in r.output
        assert re.match(rf"error: the config to validate with breaks \d rule\(s\) \(.*{rule}.*\); not validating",
                        lines[-1]), lines[-1]


def test_a_wrong_kind_of_folder_is_named_with_the_command_that_takes_it(ckpt: tuple[Path, dict], tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A user trial: an empty path said "no committed checkpoint in." (no path), an HF folder given as a checkpoint
    did not suggest import-hf, and import-hf given a moectl checkpoint or a .safetensors file said only that
    config.json is not there."""
    root, _ = ckpt
    monkeypatch.chdir(tmp_path)
    r = invoke("inspect", "")  # not a checkpoints folder: the path is wrong (exit 2, it was 1)
    assert r.exit_code == 2 and f"no committed checkpoint in the current folder ({tmp_path})" in r.output
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    r = invoke("inspect", hf)
    assert "it looks like a Hugging Face model folder: make a checkpoint of it with moectl ckpt import-hf" in r.output
    assert r.exit_code == 2, r.output
    r = invoke("import-hf", root, tmp_path / "out")
    assert r.exit_code == 2 and f"{root} is a moectl checkpoint, which train and the ckpt commands load" in r.output
    r = invoke("import-hf", hf / "model.safetensors", tmp_path / "out")
    assert r.exit_code == 2 and "model.safetensors is a file, not a model folder" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("cmd", ["inspect", "validate", "convert", "export-hf"])
def test_a_bad_latest_is_explained_in_the_words_of_the_command_that_met_it(
    cmd: str, ckpt: tuple[Path, dict], tmp_path: Path
) -> None:
    """From a user trial: a `latest` naming a missing or uncommitted step told `ckpt inspect` to "point
    checkpoint.load at" a step folder; the tools take a PATH argument, so they say which one to pass."""
    root, _ = ckpt
    extra = {"convert": ["--layout", "per-expert"], "export-hf": ["--format", "mixtral"]}.get(cmd)
    args = [root, tmp_path / "out", *extra] if extra else [root]
    good = root / "step_00000007"
    (root / "latest").write_text("step_00000099\n")
    for said in ("names step_00000099, which does not exist", "names step_00000099, which has no manifest.json"):
        if "manifest" in said:
            (root / "step_00000099").mkdir()  # an uncommitted save
        r = invoke(cmd, *args)
        assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
        assert said in r.output and "checkpoint.load" not in r.output, r.output
        assert f"fix: pass a step folder such as {good}, or delete latest" in r.output, r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cmd", ["inspect", "validate", "convert", "export-hf"])
def test_a_run_folder_given_as_a_checkpoint_exits_2_naming_the_one_to_pass(
    cmd: str, ckpt: tuple[Path, dict], tmp_path: Path
) -> None:
    """A user trial: a run folder (train's run_dir: checkpoints/, metrics.jsonl, ...) given as the checkpoint
    exited 1, as a bad checkpoint does, where a file exits 2."""
    import shutil

    root, _ = ckpt
    run = tmp_path / "myrun"
    shutil.copytree(root, run / "checkpoints")
    (run / "metrics.jsonl").write_text("{}\n")
    extra = {"convert": ["--layout", "per-expert"], "export-hf": ["--format", "mixtral"]}.get(cmd)
    r = invoke(cmd, *([run, tmp_path / "out", *extra] if extra else [run]))
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output, r.output
    assert r.output.strip() == (f"error: {run} is a run folder, not a checkpoint. "
                                f"fix: pass {run / 'checkpoints'} (its latest step, step_00000007)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cmd", ["inspect", "validate", "convert", "export-hf"])
def test_a_file_given_as_the_checkpoint_is_one_line_worded_alike_by_every_command(cmd: str, tmp_path: Path) -> None:
    """`ckpt validate` said "checkpoint path F is not a folder" where inspect, convert and export-hf said "is a file,
    not a checkpoint folder": one wording (`ckpt.discovery.checkpoint_folder`), exit 2 everywhere."""
    afile = tmp_path / "model.safetensors"
    afile.write_bytes(b"x")
    extra = {"convert": ["--layout", "per-expert"], "export-hf": ["--format", "mixtral"]}.get(cmd)
    r = invoke(cmd, *([afile, tmp_path / "out", *extra] if extra else [afile]))
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.strip() == (f"error: checkpoint path {afile} is a file, not a checkpoint folder. "
                                "fix: give a step_NNNNNNNN folder or a checkpoints folder (e.g. runs/tiny/checkpoints)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cmd", ["inspect", "validate", "convert", "export-hf"])
def test_a_folder_that_is_no_checkpoints_folder_exits_2_one_without_a_commit_yet_1(
    cmd: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user trial: an HF model folder, an empty folder or "" (the current folder) given as the checkpoint exited 1,
    which to a script means a bad checkpoint; the path is wrong: exit 2, the same one line. A checkpoints folder
    whose run has committed no step yet (its saves interrupted, or emptied) is a real state: exit 1, saying so."""
    extra = {"convert": ["--layout", "per-expert"], "export-hf": ["--format", "mixtral"]}.get(cmd)

    def run(path: object) -> Any:
        return invoke(cmd, *([path, tmp_path / "out", *extra] if extra else [path]))

    fix = ". fix: give a step_NNNNNNNN folder or a checkpoints folder (e.g. runs/tiny/checkpoints)"
    hf, empty = tmp_path / "hf", tmp_path / "empty"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    empty.mkdir()
    monkeypatch.chdir(empty)
    for path, said in (
        (hf, f"no committed checkpoint in {hf}; it looks like a Hugging Face model folder: make a checkpoint of it "
             "with moectl ckpt import-hf"),
        (empty, f"no committed checkpoint in {empty}; it is not a checkpoints folder (no step_NNNNNNNN folder in it)"),
        ("", f"no committed checkpoint in the current folder ({empty}); it is not a checkpoints folder (no "
             "step_NNNNNNNN folder in it)"),
    ):  # fmt: skip
        r = run(path)
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert r.output.strip() == f"error: {said}{fix}"
    ck = tmp_path / "checkpoints"
    (ck / "step_00000002.tmp-ab12").mkdir(parents=True)  # a run killed in its first save
    for saves in (" (uncommitted: step_00000002.tmp-ab12)", ""):
        r = run(ck)
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        assert r.output.strip() == f"error: no committed checkpoint in {ck}: no step was committed yet{saves}{fix}"
        if saves:
            (ck / "step_00000002.tmp-ab12").rmdir()  # then restarted, which removed it: still that run's folder
    assert not (tmp_path / "out").exists()


def test_the_module_docstring_gives_each_error_its_own_exit_code(ckpt: tuple[Path, dict], tmp_path: Path) -> None:
    """moectl/cli/ckpt.py said its errors were "exit code 1 through `command`"; a CheckpointArgumentError (a path
    that does not exist, a run folder, an existing destination) exits 2. The docstring says so, and is true."""
    from moectl.cli import ckpt as cli_ckpt
    from moectl.core.errors import CheckpointArgumentError, CheckpointError, ConfigError, UsageError

    doc = " ".join((cli_ckpt.__doc__ or "").split())
    assert "exit code 1 through" not in doc
    assert f"{CheckpointError.exit_code} for a `CheckpointError`" in doc and CheckpointError.exit_code == 1
    assert f"{CheckpointArgumentError.exit_code} for the command's own fault, a `CheckpointArgumentError`" in doc
    assert CheckpointArgumentError.exit_code == UsageError.exit_code == ConfigError.exit_code == 2
    root, _ = ckpt
    assert invoke("inspect", tmp_path / "nope").exit_code == 2  # CheckpointArgumentError
    assert invoke("convert", root, root, "--layout", "per-expert").exit_code == 2  # an existing destination
    (root / "latest").write_text("step_00000099\n")
    assert invoke("inspect", root).exit_code == 1  # CheckpointError: a bad checkpoints folder


def test_validate_refuses_only_what_the_override_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review of the rule check: a saved ep=2 config checked in one process (MOE029) or an empty load path an
    older run recorded (MOE074) break rules of their own; validate handles those itself (the ep hint, its own
    load path), so a harmless --set must not turn them into a refusal. What the --set breaks still refuses."""
    import copy

    from moectl.cli.ckpt import _ruled
    from moectl.core.config import config_to_dict
    from moectl.core.errors import UsageError
    from moectl.core.config.load import load_config, overridden

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    saved = config_to_dict(load_config(None, ["parallel.expert_model_parallel_size=2", "checkpoint.load=''",
                                              "moe.num_experts=4", "moe.router_topk=2"]))
    cfg = _ruled(overridden(["train.log_interval=5"]))(copy.deepcopy(saved))
    assert cfg.train.log_interval == 5 and cfg.parallel.expert_model_parallel_size == 2
    with pytest.raises(UsageError, match=r"breaks 1 rule\(s\) \(MOE018\)"):
        _ruled(overridden(["moe.router_topk=9"]))(copy.deepcopy(saved))
    # another model than the saved one: usage (it said "invalid", exit 1, blaming the checkpoint)
    with pytest.raises(UsageError, match=r"moe.num_experts: checkpoint 4, config 8, because of --set/--config"):
        _ruled(overridden(["moe.num_experts=8"]))(copy.deepcopy(saved))
    other_layout = _ruled(overridden(["moe.single_grouped_weight=false"]))(copy.deepcopy(saved))
    assert other_layout.moe.single_grouped_weight is False  # a layout is no other model
