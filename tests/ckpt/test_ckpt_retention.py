"""Acceptance test 15 (storage half): keep_last keeps exactly the newest committed steps and nothing else dies.

(Rank != 0 never deleting is checked with two ranks in test_ckpt_multirank.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_fixtures import make_meta

from ckpt import apply_retention, find_latest, list_committed, save_checkpoint


def _save(root: Path, step: int, keep_last: int | None) -> Path:
    files = {"model-00000.safetensors": {"w": torch.full((2,), float(step))}}
    return save_checkpoint(root, step, files, make_meta(consumed_samples=step), keep_last=keep_last)


def test_keep_last_2_over_steps_5_to_30(tmp_path: Path) -> None:
    # Debris that retention must not take for a committed step: an interrupted save, a folder that lost
    # its manifest, a half-deleted folder, and an unrelated file.
    (tmp_path / "step_00000001.tmp-abcd").mkdir()
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "step_00000003.trash-abcd").mkdir()
    (tmp_path / "README").write_text("mine")
    for step in range(5, 31, 5):
        _save(tmp_path, step, keep_last=2)
        kept = [p.name for p in list_committed(tmp_path)]
        assert kept == [f"step_{s:08d}" for s in range(max(5, step - 5), step + 1, 5)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "README", "latest", "step_00000001.tmp-abcd", "step_00000002", "step_00000003.trash-abcd",
        "step_00000025", "step_00000030",
    ]  # fmt: skip
    assert find_latest(tmp_path) == tmp_path / "step_00000030"


def test_the_step_latest_names_is_never_deleted(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        _save(tmp_path, step, keep_last=None)
    (tmp_path / "latest").write_text("step_00000005\n")  # e.g. resumed from an older step by hand
    deleted = apply_retention(tmp_path, 1)
    assert [p.name for p in deleted] == ["step_00000010"]
    assert [p.name for p in list_committed(tmp_path)] == ["step_00000005", "step_00000015"]


def test_keep_last_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last must be a positive int"):
        apply_retention(tmp_path, 0)
    assert apply_retention(tmp_path, None) == []
