"""Where `ckpt convert` and `ckpt export-hf` may write (`ckpt/destination.new_destination`): a new, makeable
folder outside the source step folder and outside the checkpoints folder that holds it.

A user trial found both holes: an export into the source step folder made the source fail its own
verification (a folder its manifest does not list), and a convert written into the source run's checkpoints
folder as `step_00000020` stopped that run later when it saved step 20."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from moe_ckpt_fixtures import build_model, save_model_checkpoint, tiny_config

from ckpt import verify_checkpoint
from ckpt.convert import convert_checkpoint
from ckpt.hf import export_hf
from moectl.core.errors import CheckpointArgumentError


#: a tiny model Qwen3-MoE can express (tests/ckpt/test_ckpt_hf.py's)
QWEN = {"model": {"qk_layernorm": True, "tie_embeddings": True, "moe_layer_freq": [0, 1], "ffn_hidden_size": 48},
        "moe": {"router_norm_topk_prob": False}}


def _source(tmp_path: Path) -> Path:
    cfg = tiny_config(**QWEN)
    return save_model_checkpoint(tmp_path / "run" / "checkpoints", cfg, build_model(cfg).state_dict())


def test_convert_and_export_refuse_the_source_and_its_checkpoints_folder(tmp_path: Path) -> None:
    src = _source(tmp_path)
    root = src.parent
    assert (root / "latest").is_file()
    for dst in (src / "hfout", src / "a" / "b"):
        for write in (lambda d: convert_checkpoint(src, d, "per-expert"), lambda d: export_hf(src, d, "qwen3-moe")):
            with pytest.raises(CheckpointArgumentError, match="inside the source checkpoint"):
                write(dst)
    for dst in (root / "step_00000020", root / "converted", root / "x" / "y"):
        for write in (lambda d: convert_checkpoint(src, d, "per-expert"), lambda d: export_hf(src, d, "qwen3-moe")):
            with pytest.raises(CheckpointArgumentError, match="checkpoints folder of the source"):
                write(dst)
    with pytest.raises(CheckpointArgumentError, match="checkpoints folder of the source"):
        convert_checkpoint(root, root / "step_00000020", "per-expert")  # the source named by its folder
    assert sorted(p.name for p in root.iterdir()) == ["latest", src.name] and verify_checkpoint(src) == []


def test_the_run_folder_around_it_and_a_lone_step_folder_s_siblings_are_fine(tmp_path: Path) -> None:
    src = _source(tmp_path)
    # beside checkpoints/: no save goes there
    out = convert_checkpoint(src, tmp_path / "run" / "per-expert", "per-expert")
    assert verify_checkpoint(out) == []
    lone = tmp_path / "lone" / src.name  # a step folder copied out of its checkpoints folder: no latest beside it
    shutil.copytree(src, lone)
    assert verify_checkpoint(convert_checkpoint(lone, tmp_path / "lone" / "converted", "per-expert")) == []


@pytest.mark.skipif(not Path("/sys/kernel").is_dir() or os.geteuid() != 0,
                    reason="needs sysfs, and root: the permission bits already refuse /sys to anyone else")
def test_a_folder_the_os_refuses_even_to_root_is_refused_up_front(tmp_path: Path) -> None:
    """The permission bits said /sys was writable to root; the OS refuses the folder: convert ran, then failed
    with a save's error written for training runs (exit 1). Now the OS is asked first (exit 2)."""
    src = _source(tmp_path)
    with pytest.raises(CheckpointArgumentError,
                       match=r"destination /sys/moectl-test cannot be made: /sys is not writable"):
        convert_checkpoint(src, Path("/sys/moectl-test"), "per-expert")
    assert verify_checkpoint(src) == []


def test_a_full_disk_mid_write_is_one_line_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC after the checks: convert said "saving checkpoint step 7 ... failed on rank 0 ... save again" (a
    training run's wording) and export-hf printed safetensors' traceback. Both are one line naming the
    destination and the OS's reason; nothing is left behind. Other failures keep their own errors."""
    import safetensors

    import ckpt.hf
    from ckpt.save import CheckpointSaveError
    from moectl.core.errors import CheckpointError

    src = _source(tmp_path)
    monkeypatch.setenv("MOECTL_CKPT_FAIL", "0:write:enospc")
    with pytest.raises(CheckpointError, match=r"writing the converted checkpoint .*conv failed: OSError: \[Errno 28\] "
                                              r"No space left on device") as info:
        convert_checkpoint(src, tmp_path / "conv", "per-expert")
    assert "make room on that disk" in info.value.fix and not (tmp_path / "conv").exists()
    monkeypatch.setenv("MOECTL_CKPT_FAIL", "0:write")  # not the OS's refusal: the save's own error
    with pytest.raises(CheckpointSaveError):
        convert_checkpoint(src, tmp_path / "conv", "per-expert")
    monkeypatch.delenv("MOECTL_CKPT_FAIL")

    def full(*args: object, **kwargs: object) -> None:
        raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                          'message: "No space left on device" })')

    monkeypatch.setattr(ckpt.hf, "save_file", full)
    with pytest.raises(CheckpointError, match=r"writing the export .*hf failed: No space left on device$"):
        export_hf(src, tmp_path / "hf", "qwen3-moe")

    def broken(*args: object, **kwargs: object) -> None:  # not the disk being full: not blamed on the destination
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(ckpt.hf, "save_file", broken)
    with pytest.raises(OSError, match="Input/output error"):
        export_hf(src, tmp_path / "hf", "qwen3-moe")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no half-written export, no temporary folder
    assert verify_checkpoint(src) == []
