"""`moectl ckpt validate`: good checkpoints pass (own config, other layout, other world size); tampered fail."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from dist_helpers import run_distributed
from trainer.observer import SilentObserver
from safetensors.torch import load_file, save

from moectl.core.config.load import overridden
from ckpt.digest import tree_digest
from ckpt.seal import seal
from trainer.validation import validate_checkpoint
from moectl.core.config.load import load_config
from trainer.loop import Trainer

FAST = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=32", "moe.num_experts=4", "moe.ffn_hidden_size=16", "train.micro_batch_size=2",
    "train.global_batch_size=4", "data.source=synthetic", "train.eval_interval=null", "train.train_iters=3",
    "checkpoint.save_interval=3",
]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("v")
    Trainer(load_config(None, [*FAST, f"run_dir={root}"]), SilentObserver()).run()
    return root / "checkpoints" / "step_00000003"


def stages(report):
    return {c.stage for c in report.checks}


def test_good_checkpoint_passes_every_stage(ckpt_dir):
    report = validate_checkpoint(ckpt_dir)
    assert report.ok, report.failures()
    assert stages(report) == {"integrity", "restore", "master", "moment", "param", "weight", "probe"}
    probe = [c for c in report.checks if c.stage == "probe"][0]
    assert "bitwise" in probe.detail
    assert report.counts["master"] == report.counts["param"] == report.counts["weight"] > 10


def test_passes_into_the_other_layout(ckpt_dir):
    report = validate_checkpoint(ckpt_dir, overridden(["moe.single_grouped_weight=false"]))
    assert report.ok, report.failures()
    assert any(c.name.endswith("linear_fc1.weight3.main_param") for c in report.checks)


def test_a_layout_that_does_not_fit_this_world_is_bad_usage_not_invalid(ckpt_dir):
    """An ep=2 checkpoint validated in one process was reported 'invalid' (exit 1: a script reads a corrupt
    checkpoint); the checkpoint is fine and the command is not, so it is a usage error naming the --set."""
    from moectl.core.errors import UsageError

    with pytest.raises(UsageError) as err:
        validate_checkpoint(ckpt_dir, overridden(["parallel.expert_model_parallel_size=2"]))
    assert err.value.exit_code == 2
    assert "--set parallel.expert_model_parallel_size=N, N one of [1]" in err.value.one_line()


def test_another_optimizer_asked_for_is_bad_usage_not_invalid(ckpt_dir):
    """`--set optimizer.optimizer=sgd` on an Adam checkpoint said "invalid" (exit 1) of a valid checkpoint; with
    no_load_optim its weights are checked and pass."""
    from moectl.core.errors import UsageError

    with pytest.raises(UsageError) as err:
        validate_checkpoint(ckpt_dir, overridden(["optimizer.optimizer=sgd"]))
    assert err.value.exit_code == 2 and "holds the state of optimizer adam, not sgd" in err.value.one_line()
    assert "checkpoint.no_load_optim=true" in err.value.one_line()
    report = validate_checkpoint(ckpt_dir, overridden(["optimizer.optimizer=muon", "checkpoint.no_load_optim=true"]))
    assert report.ok, report.failures()


def test_the_ep_hint_names_torchruns_world_before_the_rendezvous(ckpt_dir, monkeypatch):
    """Under torchrun the size check runs before the process group exists: the choices are WORLD_SIZE's."""
    from moectl.core.errors import UsageError

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UsageError) as err:
        validate_checkpoint(ckpt_dir, overridden(["parallel.expert_model_parallel_size=3"]))
    assert "N one of [1, 2, 4]" in err.value.one_line()


def _validate_on_two_ranks(rank, world, path):
    # two gloo ranks on the CPU, also on a one-GPU host (where the checkpoint was trained on the GPU: rank 1 has none)
    r = validate_checkpoint(path, overridden(["train.device=cpu"]))
    return [(c.stage, c.name, c.ok, c.detail) for c in r.checks if not c.ok], r.ok


@pytest.mark.slow
def test_passes_at_another_world_size(ckpt_dir):
    for failures, ok in run_distributed(_validate_on_two_ranks, path=str(ckpt_dir)):
        assert ok, failures


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_flipped_byte_fails_integrity_naming_the_file(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir, tmp_path / "step_00000003")
    f = sorted(d.glob("optim-*.safetensors"))[0]
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40
    f.write_bytes(bytes(data))
    in_file = {n for n, rec in json.loads((d / "manifest.json").read_text())["tensors"].items() if rec["file"] == f.name}
    report = validate_checkpoint(d)
    assert not report.ok
    failures = report.failures()
    assert failures and all(c.stage == "integrity" for c in failures)
    assert any(f.name in c.detail or c.name == f.name or c.name in in_file for c in failures), failures
    assert "restore" not in stages(report)


def _edit_and_forge(d, name, sealed=True):
    """Scale tensor `name` of step folder `d` by 1.5 (plausible-looking, wrong) and forge every hash of its
    file so integrity passes; `sealed`: the manifest's own digest too. Returns the edited manifest."""
    manifest = json.loads((d / "manifest.json").read_text())
    fname = manifest["tensors"][name]["file"]
    tensors = load_file(d / fname)
    tensors[name] = tensors[name] * 1.5
    data = save(tensors, metadata={"format": "pt"})
    (d / fname).write_bytes(data)
    # Forge every hash so integrity passes: only the probe can tell.
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    for tname, info in header.items():
        if tname != "__metadata__":
            b, e = info["data_offsets"]
            manifest["tensors"][tname]["sha256"] = hashlib.sha256(data[8 + n + b : 8 + n + e]).hexdigest()
    spans = sorted((info["data_offsets"], t) for t, info in header.items() if t != "__metadata__")
    tree = tree_digest(hashlib.sha256(data[: 8 + n]).hexdigest(), (manifest["tensors"][t]["sha256"] for _, t in spans))
    manifest["files"][fname].update(sha256=tree, size=len(data))  # the file's digest (format 3, ckpt/digest.py)
    (d / "manifest.json").write_text(json.dumps(seal(manifest) if sealed else manifest))
    return manifest


def test_master_edited_with_its_hashes_updated_is_caught_by_the_probe(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir, tmp_path / "step_00000003")
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    _edit_and_forge(d, name + ".main_param", sealed=False)
    # The manifest's own digest (ckpt/seal.py) notices the edited hashes...
    assert {c.stage for c in validate_checkpoint(d).failures()} == {"integrity"}
    # ...so forge it as well: now the probe and the saved weight (no longer the master's cast) tell.
    _edit_and_forge(_copy(ckpt_dir, tmp_path / "b" / "step_00000003"), name + ".main_param")
    report = validate_checkpoint(tmp_path / "b" / "step_00000003")
    assert {(c.stage, c.name) for c in report.failures()} == {("probe", "-"), ("weight", name)}, report.failures()


def test_a_model_weight_edited_with_its_hashes_updated_fails_the_weight_check(ckpt_dir, tmp_path):
    """The live params are rebuilt from the masters, so the "param" rows and the probe never see the model file:
    a user trial scaled one weight there, resealed, and validate said valid (export-hf then wrote it)."""
    d = _copy(ckpt_dir, tmp_path / "step_00000003")
    name = "decoder.layers.0.mlp.experts.linear_fc2.weight"
    _edit_and_forge(d, name)
    report = validate_checkpoint(d)
    assert [(c.stage, c.name) for c in report.failures()] == [("weight", name)], report.failures()
    assert "checkpoint weight != its master cast to torch.float32" in report.failures()[0].detail


def test_no_load_optim_is_honoured_and_the_weights_are_checked(ckpt_dir):
    report = validate_checkpoint(ckpt_dir, overridden(["checkpoint.no_load_optim=true"]))
    assert report.ok, report.failures()
    assert stages(report) == {"integrity", "restore", "master", "weight", "probe"}
    master = [c for c in report.checks if c.stage == "master"]
    assert len(master) == 1 and "not loaded: checkpoint.no_load_optim=true" in master[0].detail
    assert "bitwise" in [c for c in report.checks if c.stage == "probe"][0].detail


def test_a_master_restored_one_ulp_off_fails_the_master_check(ckpt_dir, monkeypatch):
    """The master check is bitwise: a restore that lands one master element one ulp away (a cast, a wrong
    reduction order) must fail it, naming the tensor, whatever the param and probe checks say."""
    import trainer.loop as loop

    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    real = loop.load_training_checkpoint

    def one_ulp_off(path, cfg, model, engine, pstate, **kw):
        load = engine.load_logical_state

        def nudged(params, step):
            m = params[name]["master"].clone()
            m.view(-1)[0] = torch.nextafter(m.view(-1)[0], torch.tensor(float("inf")))
            params[name]["master"] = m
            load(params, step)

        engine.load_logical_state = nudged
        return real(path, cfg, model, engine, pstate, **kw)

    monkeypatch.setattr(loop, "load_training_checkpoint", one_ulp_off)
    report = validate_checkpoint(ckpt_dir)
    failed = {(c.stage, c.name) for c in report.failures()}
    assert ("master", name + ".main_param") in failed, report.failures()
    assert not report.ok


def test_overrides_do_not_leak_into_the_checkpoints_own_config(tmp_path):
    """Validating an interleave-8 checkpoint into an interleave-null model is another layout: the probe gets
    the tolerance, and says so. (A shallow copy of the stored config let `--set` overwrite it, so the "same
    config?" check compared the override with itself and demanded, or claimed, bitwise.)"""
    Trainer(load_config(None, [*FAST, f"run_dir={tmp_path}", "moe.glu_interleave_size=8"]), SilentObserver()).run()
    step = tmp_path / "checkpoints" / "step_00000003"
    report = validate_checkpoint(step, overridden(["moe.glu_interleave_size=null"]))
    assert report.ok, report.failures()
    (probe,) = [c for c in report.checks if c.stage == "probe"]
    assert "other layout" in probe.detail and "bitwise" not in probe.detail, probe.detail


def _merge_on_two_ranks(rank, world):
    from trainer.validation import Check, ValidationReport, merge_ranks

    report = ValidationReport(Path("ck"))
    report.add(Check("integrity", "-", True, "sha256"))
    report.add(Check("integrity", "model-00000.safetensors", False, "sha256 differs"))  # every rank finds it
    report.add(Check("master", f"w{rank}", True, "equal"))
    if rank == 1:
        report.add(Check("master", "w9", False, "max |diff| 1.0"))
    merged = merge_ranks(report)
    return merged.ok, [(c.stage, c.name, c.ok, c.detail) for c in merged.checks], merged.counts


@pytest.mark.slow
def test_ranks_merge_into_one_verdict():
    """Each rank proves its own tensors: rank 1's failure reaches rank 0's report (which alone read valid), every
    rank gets the same verdict, and counts add up over the ranks (integrity once: all ranks hash the same files)."""
    results = run_distributed(_merge_on_two_ranks)
    assert results[0] == results[1]
    ok, checks, counts = results[0]
    assert not ok
    assert ("master", "w9", False, "rank 1: max |diff| 1.0") in checks and ("master", "w0", True, "equal") in checks
    assert [c for c in checks if c[0] == "integrity" and not c[2]] == [
        ("integrity", "model-00000.safetensors", False, "sha256 differs")]  # once, not once per rank
    assert counts == {"integrity": 2, "master": 3}
