"""File digests by format (ckpt/digest.py): format 3's sha256 tree is verified and names changed tensors;
checkpoints of formats 1-2, whose files recorded the whole file's sha256, still verify and still name them."""

from __future__ import annotations

import json
from pathlib import Path

from ckpt_fixtures import save_simple, whole_file_digests

from ckpt import open_checkpoint, verify_checkpoint
from ckpt import problems as P
from ckpt.digest import TREE
from ckpt.seal import seal
from ckpt.st_header import read_header

MODEL = "model-00000.safetensors"


def _rewrite(step: Path, edit) -> None:
    m = json.loads((step / "manifest.json").read_text())
    edit(m)
    (step / "manifest.json").write_text(json.dumps(m))


def _flip(step: Path) -> str:
    header, _ = read_header(step / MODEL)
    assert header is not None
    entry = max(header.entries.values(), key=lambda e: e.end - e.start)
    data = bytearray((step / MODEL).read_bytes())
    data[entry.start + 3] ^= 0x10
    (step / MODEL).write_bytes(bytes(data))
    return entry.name


def test_a_saved_manifest_says_its_files_carry_the_tree_digest(tmp_path: Path) -> None:
    step = save_simple(tmp_path, 3)
    m = json.loads((step / "manifest.json").read_text())
    assert m["format_version"] == 3 and m["file_digest"] == TREE


def test_a_format_2_checkpoint_verifies_and_names_a_changed_tensor(tmp_path: Path) -> None:
    step = save_simple(tmp_path, 3)

    def as_format_2(m: dict) -> None:
        whole_file_digests(step, m)
        m["format_version"] = 2
        m.update(seal(m))

    _rewrite(step, as_format_2)
    assert verify_checkpoint(step) == []
    open_checkpoint(step).close()
    changed = _flip(step)
    problems = verify_checkpoint(step)
    assert [(p.kind, p.file, p.tensor) for p in problems] == [(P.SHA256, MODEL, changed)]


def test_format_3_names_a_changed_tensor_and_an_unknown_digest_is_refused(tmp_path: Path) -> None:
    step = save_simple(tmp_path, 3)
    changed = _flip(step)
    problems = verify_checkpoint(step)
    assert [(p.kind, p.file, p.tensor) for p in problems] == [(P.SHA256, MODEL, changed)]
    other = save_simple(tmp_path / "other", 3)
    _rewrite(other, lambda m: m.update(seal({**m, "file_digest": "blake3-tree"})))
    (problem,) = verify_checkpoint(other)
    assert problem.kind == P.MANIFEST and "file_digest is 'blake3-tree'" in problem.message
