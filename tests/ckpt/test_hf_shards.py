"""The HF export's shard writer (ckpt/hf.py): its files get the permissions any new file would."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ckpt.hf import _ShardWriter


def test_exported_shards_are_readable_as_other_new_files_are(tmp_path: Path) -> None:
    """safetensors creates its file 0600, so an export shared with a team was readable by its owner alone."""
    for limit, names in ((1 << 30, ["model.safetensors"]),
                         (16, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])):  # fmt: skip
        folder = tmp_path / str(limit)
        folder.mkdir()
        w = _ShardWriter(folder, limit)
        w.add({"a": torch.zeros(4)})
        w.add({"b": torch.ones(4)})
        w.close()
        (folder / "probe").write_text("x")  # a file made the ordinary way, under the same umask
        want = os.stat(folder / "probe").st_mode & 0o777
        for name in names:
            assert os.stat(folder / name).st_mode & 0o777 == want, name
