"""`convert_checkpoint` on checkpoints of real GPTMoE models: round trips bit-exact for weights, masters and
moments; the converted tensors load into a model of the new layout; interleave 32 -> none keeps the forward."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from moe_ckpt_fixtures import (
    assert_same_tensors,
    build_model,
    fake_optimizer,
    meta_for,
    read_all,
    save_model_checkpoint,
    tiny_config,
)

from ckpt import open_checkpoint, save_checkpoint, verify_checkpoint
from ckpt.convert import convert_checkpoint
from ckpt.layout import normalize_for_model
from moectl.core.errors import CheckpointError

FC1 = "decoder.layers.{}.mlp.experts.linear_fc1.{}"


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))


def test_per_expert_to_single_to_per_expert_is_bit_exact(tmp_path: Path) -> None:
    # bf16 model weights with per-expert biases, fp32 masters and moments: every dtype path of a real run
    cfg = tiny_config(moe={"single_grouped_weight": False, "add_bias": True})
    state = build_model(cfg, dtype=torch.bfloat16).state_dict()
    optim = fake_optimizer(state)
    src = save_model_checkpoint(tmp_path / "src", cfg, state, optim)
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight3.exp_avg_sq" in optim

    mid = convert_checkpoint(src, tmp_path / "grouped", "single-grouped")
    assert mid == tmp_path / "grouped" / "step_00000007" and verify_checkpoint(mid) == []
    got = read_all(mid)
    for suffix in ("", ".main_param", ".exp_avg", ".exp_avg_sq"):
        for kind, n in (("weight", 3), ("bias", 2)):
            name = FC1.format(1, kind) + suffix
            want = torch.stack([(state if not suffix else optim)[FC1.format(1, f"{kind}{e}") + suffix] for e in range(4)])
            assert got[name].dim() == n and torch.equal(got[name], want), name
            assert FC1.format(1, f"{kind}0") + suffix not in got
    back = convert_checkpoint(mid, tmp_path / "back", "per-expert")
    assert_same_tensors(read_all(back), {**state, **optim})


def test_single_to_per_expert_to_single_is_bit_exact_and_meta_is_carried(tmp_path: Path) -> None:
    cfg = tiny_config(moe={"glu_interleave_size": 32})
    state = build_model(cfg).state_dict()
    optim = fake_optimizer(state)
    src = save_model_checkpoint(tmp_path / "src", cfg, state, optim)
    per = convert_checkpoint(tmp_path / "src", tmp_path / "per", "per-expert")  # a checkpoints folder: its latest
    back = convert_checkpoint(per, tmp_path / "back", "single-grouped")
    assert_same_tensors(read_all(back), {**state, **optim})
    with open_checkpoint(src) as a, open_checkpoint(per) as b, open_checkpoint(back) as c:
        assert b.meta["expert_layout"] == "per-expert" and c.meta["expert_layout"] == "single-grouped"
        assert b.meta["config"]["moe"]["single_grouped_weight"] is False
        assert c.meta == a.meta  # everything else carried over, and the round trip restores the layout keys
        for key in ("consumed_samples", "recipe", "world", "sampler", "rng", "probe", "train_state"):
            assert b.meta[key] == a.meta[key], key
        assert b.step == a.step == 7 and b.meta["glu_interleave_size"] == 32
        # same file per tensor (nothing moved between model and optim files)
        assert {n: a.tensor_info(n).file for n in a.tensor_names()} == {n: c.tensor_info(n).file for n in c.tensor_names()}


def test_converted_tensors_load_into_a_model_of_the_new_layout(tmp_path: Path) -> None:
    cfg = tiny_config(moe={"single_grouped_weight": False})
    model = build_model(cfg)
    src = save_model_checkpoint(tmp_path / "src", cfg, model.state_dict())
    out = convert_checkpoint(src, tmp_path / "out", "single-grouped")
    grouped = build_model(tiny_config(), seed=9)  # single-grouped, other values
    grouped.load_state_dict(read_all(out), strict=True)
    with torch.no_grad():
        assert torch.equal(grouped(_tokens()), model(_tokens()))


def test_experts_split_over_files_are_stacked_into_expert_0s_file(tmp_path: Path) -> None:
    # expert parallelism: rank 0 saved experts 0-1, rank 1 experts 2-3 of every layer
    cfg = tiny_config(moe={"single_grouped_weight": False})
    state = build_model(cfg).state_dict()
    late = {n: t for n, t in state.items() if n[-1] in "23" and ".experts." in n}
    files = {"model-00000.safetensors": {n: t for n, t in state.items() if n not in late}, "model-00001.safetensors": late}
    src = save_model_checkpoint(tmp_path / "src", cfg, state, files=files)
    out = convert_checkpoint(src, tmp_path / "out", "single-grouped")
    with open_checkpoint(out) as ck:
        assert ck.tensor_info(FC1.format(0, "weight")).file == "model-00000.safetensors"
        assert [n for n in ck.tensor_names() if ck.tensor_info(n).file == "model-00001.safetensors"] == []
    back = convert_checkpoint(out, tmp_path / "back", "per-expert")
    assert_same_tensors(read_all(back), state)


def test_interleave_32_checkpoint_runs_the_same_in_an_interleave_none_model(tmp_path: Path) -> None:
    cfg32 = tiny_config(moe={"glu_interleave_size": 32, "add_bias": True, "single_grouped_bias": True})
    model32 = build_model(cfg32)
    state = model32.state_dict()
    optim = fake_optimizer(state)
    src = save_model_checkpoint(tmp_path / "src", cfg32, state, optim)

    cfg_plain = tiny_config(moe={"add_bias": True, "single_grouped_bias": False, "single_grouped_weight": False})
    plain = build_model(cfg_plain, seed=5)
    with open_checkpoint(src) as ck:  # the loader's path: one normalisation to the model's layout and interleave
        tensors = {n: ck.read(n) for n in ck.tensor_names()}
        loaded = normalize_for_model(tensors, num_experts=4, target_layout="per-expert", source_interleave=32,
                                     target_interleave=None, ffn_size=64)  # fmt: skip
    plain.load_state_dict({n: t for n, t in loaded.items() if not n.endswith(("main_param", "exp_avg", "exp_avg_sq"))})
    with torch.no_grad():
        want, got = model32(_tokens(1)), plain(_tokens(1))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # rows moved, not values: gate row f of expert e was at (f // 32) * 64 + f % 32, up row at that + 32
    w32 = state[FC1.format(0, "weight")]
    m32 = optim[FC1.format(0, "weight") + ".main_param"]
    for f in (0, 31, 32, 63):
        r = (f // 32) * 64 + f % 32
        assert torch.equal(loaded[FC1.format(0, "weight2")][f], w32[2, r])
        assert torch.equal(loaded[FC1.format(0, "weight2")][64 + f], w32[2, r + 32])
        assert torch.equal(loaded[FC1.format(0, "weight2") + ".main_param"][64 + f], m32[2, r + 32])
        assert torch.equal(loaded[FC1.format(0, "bias2")][64 + f], state[FC1.format(0, "bias")][2, r + 32])

    # the same through convert: meta and config follow, and interleaving back restores every bit
    out = convert_checkpoint(src, tmp_path / "plain", "single-grouped", glu_interleave_size=None)
    with open_checkpoint(out) as ck:
        assert ck.meta["glu_interleave_size"] is None and ck.meta["config"]["moe"]["glu_interleave_size"] is None
    again = convert_checkpoint(out, tmp_path / "again", "single-grouped", glu_interleave_size=32)
    assert_same_tensors(read_all(again), {**state, **optim})


def test_refuses_an_existing_destination_and_one_inside_the_source(tmp_path: Path) -> None:
    cfg = tiny_config()
    src = save_model_checkpoint(tmp_path / "src", cfg, build_model(cfg).state_dict())
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        convert_checkpoint(src, tmp_path / "taken", "per-expert")
    with pytest.raises(CheckpointError, match="inside the source"):
        convert_checkpoint(src, src / "nested", "per-expert")
    with pytest.raises(CheckpointError, match="unknown expert layout"):
        convert_checkpoint(src, tmp_path / "x", "grouped")
    with pytest.raises(CheckpointError, match="glu_interleave_size 48 must be a positive int dividing the expert ffn size 64"):
        convert_checkpoint(src, tmp_path / "x", "per-expert", glu_interleave_size=48)
    assert not (tmp_path / "x").exists() and verify_checkpoint(src) == []


def test_refuses_a_manifest_whose_layout_contradicts_the_tensors(tmp_path: Path) -> None:
    cfg = tiny_config()
    state = build_model(cfg).state_dict()
    src = save_checkpoint(tmp_path / "src", 1, {"model-00000.safetensors": state}, meta_for(cfg, expert_layout="per-expert"))
    with pytest.raises(CheckpointError, match="manifest says expert_layout 'per-expert' but the weights are single-grouped"):
        convert_checkpoint(src, tmp_path / "out", "per-expert")
    assert not (tmp_path / "out").exists()


def test_refuses_an_incomplete_expert_set_naming_the_missing_tensor(tmp_path: Path) -> None:
    cfg = tiny_config(moe={"single_grouped_weight": False})
    state = build_model(cfg).state_dict()
    optim = fake_optimizer(state)
    del optim[FC1.format(1, "weight2") + ".exp_avg"]
    src = save_model_checkpoint(tmp_path / "src", cfg, state, optim)
    with pytest.raises(CheckpointError, match=r"missing decoder\.layers\.1\.mlp\.experts\.linear_fc1\.weight2\.exp_avg"):
        convert_checkpoint(src, tmp_path / "out", "single-grouped")
    assert not (tmp_path / "out").exists()


def test_converted_manifest_is_written_by_save_checkpoint(tmp_path: Path) -> None:
    cfg = tiny_config()
    src = save_model_checkpoint(tmp_path / "src", cfg, build_model(cfg).state_dict())
    out = convert_checkpoint(src, tmp_path / "out", "per-expert")
    m = json.loads((out / "manifest.json").read_text())
    assert m["format"] == "moectl-checkpoint" and (tmp_path / "out" / "latest").read_text() == "step_00000007\n"
    assert all(len(rec["sha256"]) == 64 for rec in m["tensors"].values())


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_source_is_refused_and_nothing_is_committed(tmp_path: Path, damage: str) -> None:
    # The source is hashed while it is converted: the damage must still refuse the result, naming the source.
    cfg = tiny_config()
    state = build_model(cfg).state_dict()
    src = save_model_checkpoint(tmp_path / "src", cfg, state, fake_optimizer(state))
    shard = src / "optim-00000.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x01  # a byte of the last tensor's data: the conversion itself goes through
    else:
        data = data[: len(data) // 2]  # the conversion cannot read it either: the source's problem is named
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"refusing to load {src}: .*optim-00000.safetensors"):
        convert_checkpoint(src, tmp_path / "out", "per-expert")
    assert not (tmp_path / "out").exists()


def test_an_interrupted_convert_leaves_nothing_and_can_be_run_again(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C mid-convert left `out/step_N.tmp-<hex>` (as large as the checkpoint) and the rerun was refused."""
    import ckpt.convert as conv

    cfg = tiny_config()
    state = build_model(cfg).state_dict()
    src = save_model_checkpoint(tmp_path / "src", cfg, state, fake_optimizer(state))
    real, calls = conv.normalize_for_model, []

    def interrupted(*a: object, **kw: object) -> object:
        calls.append(1)
        if len(calls) == 2:  # the save's folder exists and holds a shard by now
            assert any(p.name.startswith("step_") and ".tmp-" in p.name for p in (tmp_path / "out").iterdir())
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(conv, "normalize_for_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(src, tmp_path / "out", "per-expert")
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(conv, "normalize_for_model", real)
    assert verify_checkpoint(convert_checkpoint(src, tmp_path / "out", "per-expert")) == []


def test_a_rerun_after_a_killed_convert_names_the_unfinished_save_to_delete(tmp_path: Path) -> None:
    """SIGKILL (the OOM killer, a scheduler) gives convert no chance to remove its `.tmp-` save: the rerun said
    only "destination already exists". It names the unfinished save; anything else there stays the plain refusal."""
    cfg = tiny_config()
    src = save_model_checkpoint(tmp_path / "src", cfg, build_model(cfg).state_dict())
    left = tmp_path / "out" / "step_00000000.tmp-1a2b3c"
    left.mkdir(parents=True)
    (left / "model-00000.safetensors").write_bytes(b"\0" * 64)  # half written
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(src, tmp_path / "out", "per-expert")
    assert e.value.message == (f"destination {tmp_path / 'out'} already exists, holding only {left.name}: the "
                               "unfinished save of a command that was killed or is still running (nothing in it was "
                               "committed)")  # a review: a running convert's folder looks the same
    assert e.value.fix.startswith(f"if no moectl command is writing there, delete it (rm -r -- {tmp_path / 'out'}) and "
                                  "run the command again")
    (left / "notes.txt").write_text("mine")  # no save writes this: the folder is not only an unfinished save
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(src, tmp_path / "out", "per-expert")
    assert e.value.message == f"destination {tmp_path / 'out'} already exists"
    assert (left / "notes.txt").exists()


def test_a_destination_that_cannot_be_made_is_refused_before_any_work(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Into a read-only folder, convert ran and then failed with a save's error written for training runs."""
    import ckpt.destination
    from moectl.core.errors import CheckpointArgumentError

    cfg = tiny_config()
    src = save_model_checkpoint(tmp_path / "src", cfg, build_model(cfg).state_dict())
    (tmp_path / "ro").mkdir()
    (tmp_path / "file").write_text("x")
    real = ckpt.destination.tempfile.mkdtemp

    def mkdtemp(prefix: str, dir: Path) -> str:  # the OS refusing as it refuses a user without write permission
        if Path(dir) == tmp_path / "ro":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real(prefix=prefix, dir=dir)

    monkeypatch.setattr(ckpt.destination.tempfile, "mkdtemp", mkdtemp)
    with pytest.raises(CheckpointArgumentError, match=rf"destination {tmp_path / 'ro' / 'out'} cannot be made: "
                                                      rf"{tmp_path / 'ro'} is not writable \(Permission denied\)"):  # fmt: skip
        convert_checkpoint(src, tmp_path / "ro" / "out", "per-expert")
    with pytest.raises(CheckpointArgumentError, match=r"file is a file, not a folder"):
        convert_checkpoint(src, tmp_path / "file" / "out", "per-expert")
    assert list((tmp_path / "ro").iterdir()) == []
