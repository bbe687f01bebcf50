"""Save -> load round trips on one process: every dtype bit-exact, sliced reads, the manifest, bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt_fixtures import bits, make_meta, mixed_tensors, save_simple

from ckpt import CheckpointSaveError, open_checkpoint, save_checkpoint, verify_checkpoint
from ckpt.manifest import FORMAT_VERSION
from moectl.core.errors import CheckpointError


def test_mixed_dtypes_round_trip_bit_exact(tmp_path: Path) -> None:
    path = save_simple(tmp_path / "checkpoints", 100, seed=3)
    assert path == tmp_path / "checkpoints" / "step_00000100"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "model-00000.safetensors", "optim-00000.safetensors"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000100\n"
    assert verify_checkpoint(path) == []
    want = mixed_tensors(3)
    with open_checkpoint(tmp_path / "checkpoints") as ck:  # a checkpoints folder: follows `latest`
        assert ck.path == path and ck.step == 100
        assert set(ck.tensor_names()) == set(want) | {"decoder.layers.0.mlp.experts.linear_fc1.weight.exp_avg"}
        for name, t in want.items():
            got = ck.read(name)
            assert got.dtype == t.dtype and got.shape == t.shape, name
            assert torch.equal(bits(got), bits(t)), name
            info = ck.tensor_info(name)
            assert (info.file, info.dtype, info.shape) == ("model-00000.safetensors", t.dtype, tuple(t.shape))
        assert torch.equal(ck.read("decoder.layers.0.mlp.experts.linear_fc1.weight.exp_avg"), torch.full((4, 16, 8), 3.0))


def test_manifest_records_meta_files_and_tensors(tmp_path: Path) -> None:
    path = save_simple(tmp_path, 7)
    m = json.loads((path / "manifest.json").read_text())
    assert m["format"] == "moectl-checkpoint" and m["format_version"] == FORMAT_VERSION and m["step"] == 7
    meta = make_meta(consumed_samples=7 * 32)
    for k, v in meta.items():
        assert m[k] == v, k
    assert (2.718281828459045).hex() == m["probe"]["loss_hex"]  # floats survive JSON exactly
    assert set(m["files"]) == {"model-00000.safetensors", "optim-00000.safetensors"}
    for fname, rec in m["files"].items():
        assert rec["size"] == (path / fname).stat().st_size and rec["rank"] == 0 and len(rec["sha256"]) == 64
    rec = m["tensors"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert (rec["file"], rec["dtype"], rec["shape"]) == ("model-00000.safetensors", "bfloat16", [24, 8])
    with open_checkpoint(path) as ck:
        assert ck.meta == meta


def test_sliced_reads_copy_only_the_slice(tmp_path: Path) -> None:
    path = save_simple(tmp_path, 1, seed=5)
    full = mixed_tensors(5)["decoder.layers.0.mlp.experts.linear_fc1.weight"]
    with open_checkpoint(path) as ck:
        name = "decoder.layers.0.mlp.experts.linear_fc1.weight"
        assert torch.equal(ck.read(name, slice(1, 3)), full[1:3])  # an expert range (ep slice)
        assert torch.equal(ck.read(name, (slice(None), slice(8, 16))), full[:, 8:16])  # rows of each expert
        assert torch.equal(ck.read(name, 2), full[2])
        bf16 = "decoder.layers.0.self_attention.linear_qkv.weight"
        assert torch.equal(bits(ck.read(bf16, slice(0, 12))), bits(mixed_tensors(5)[bf16][:12]))
        with pytest.raises(CheckpointError, match="cannot take slice"):
            ck.read(name, (slice(None), slice(None), slice(None), slice(None)))
        with pytest.raises(CheckpointError, match="has no tensor 'nope'"):
            ck.read("nope")


def test_views_sharing_memory_and_non_contiguous_tensors_are_saved_as_values(tmp_path: Path) -> None:
    flat = torch.arange(20, dtype=torch.float32)  # like main params that are views into one fp32 buffer
    files = {
        "optim-00000.safetensors": {
            "a.main_param": flat[:10].view(2, 5),
            "b.main_param": flat[5:15],  # overlaps a
            "c.main_param": flat.view(4, 5).t(),  # non-contiguous
            "d.main_param": flat,  # the same bytes again (tied)
        }
    }
    path = save_checkpoint(tmp_path, 1, files, make_meta())
    with open_checkpoint(path) as ck:
        for name, t in files["optim-00000.safetensors"].items():
            assert torch.equal(ck.read(name), t), name


def test_bad_inputs_fail_the_save_with_a_named_reason_and_commit_nothing(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir()
    good = {"model-00000.safetensors": {"w": torch.ones(2)}}
    cases = [
        (good, make_meta(expert_layout="grouped"), "expert_layout must be one of"),
        (good, {k: v for k, v in make_meta().items() if k != "probe"}, "meta is missing 'probe'"),
        (good, make_meta(probe={"loss": float("nan")}), "not strict-JSON serialisable"),
        (good, make_meta(rng={"state": b"\x00\x01"}), "not strict-JSON serialisable"),
        ({"weights.pt": {"w": torch.ones(2)}}, make_meta(), "'weights.pt' is not model-NNNNN"),
        ({"model-00000.safetensors": {"__metadata__": torch.ones(2)}}, make_meta(), "must be a non-empty str"),
        ({"model-00000.safetensors": {"w": [1.0]}}, make_meta(), "is a list, not a Tensor"),
    ]
    for files, meta, reason in cases:
        with pytest.raises(CheckpointSaveError, match=reason) as err:
            save_checkpoint(root, 1, files, meta)
        assert err.value.ranks == [0] and "failed on rank 0" in str(err.value)
        assert sorted(p.name for p in root.iterdir()) == [], reason  # nothing left behind
    with pytest.raises(CheckpointSaveError, match=r"step must be an int in \[0, 99999999\], got '7'"):
        save_checkpoint(root, "7", good, make_meta())  # type: ignore[arg-type]


def test_an_existing_step_is_never_overwritten(tmp_path: Path) -> None:
    save_simple(tmp_path, 10, seed=1)
    with pytest.raises(CheckpointSaveError, match="step_00000010 already exists"):
        save_simple(tmp_path, 10, seed=2)
    with open_checkpoint(tmp_path) as ck:
        assert torch.equal(ck.read("flags"), mixed_tensors(1)["flags"])
        assert torch.equal(bits(ck.read("scalar")), bits(mixed_tensors(1)["scalar"]))
        assert ck.read("decoder.layers.0.mlp.experts.linear_fc1.weight.exp_avg")[0, 0, 0].item() == 1.0
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
