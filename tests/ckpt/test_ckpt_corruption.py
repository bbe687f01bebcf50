"""Acceptance tests 5 and 6 (storage half): corruption is detected and named; a pickle is never executed.

Every case damages one committed checkpoint, then requires that `verify_checkpoint` reports a problem of
the expected kind naming the file (and the tensor where there is one) and that `open_checkpoint` refuses.
"""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from ckpt_fixtures import save_simple

from ckpt import open_checkpoint, verify_checkpoint
from ckpt import problems as P
from ckpt.st_header import read_header
from moectl.core.errors import CheckpointError

MODEL = "model-00000.safetensors"
OPTIM = "optim-00000.safetensors"
FC1 = "decoder.layers.0.mlp.experts.linear_fc1.weight"
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
LAST = "<the tensor stored last>"  # safetensors orders tensors by alignment, then name


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    return n, json.loads(path.read_bytes()[8 : 8 + n])


def _rewrite_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the header JSON in place, keeping its length (space padding) so the file size is unchanged."""
    data = path.read_bytes()
    n, hdr = _header(path)
    edit(hdr)
    text = json.dumps(hdr, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(data[:8] + text + b" " * (n - len(text)) + data[8 + n :])


def _flip_payload_byte(d: Path) -> None:
    path = d / MODEL
    header, _ = read_header(path)
    assert header is not None
    data = bytearray(path.read_bytes())
    data[header.entries[FC1].start + 5] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(d: Path) -> None:
    data = (d / MODEL).read_bytes()
    (d / MODEL).write_bytes(data[:-1])


def _append(d: Path) -> None:
    with open(d / MODEL, "ab") as f:
        f.write(b"\x00" * 16)


def _huge_header_length(d: Path) -> None:
    data = (d / MODEL).read_bytes()
    (d / MODEL).write_bytes(struct.pack("<Q", 200_000_000) + data[8:])


def _bad_header_json(d: Path) -> None:
    data = bytearray((d / MODEL).read_bytes())
    data[9] = ord("x")  # the opening quote of the first key
    (d / MODEL).write_bytes(bytes(data))


def _overlap_offsets(d: Path) -> None:
    def edit(hdr: dict[str, Any]) -> None:
        b, e = hdr[QKV]["data_offsets"]
        hdr[QKV]["data_offsets"] = [b - 4, e - 4]

    _rewrite_header(d / MODEL, edit)


def _shape_disagrees_with_bytes(d: Path) -> None:
    _rewrite_header(d / MODEL, lambda hdr: hdr[QKV].update(shape=[24, 9]))


def _dtype_swapped_same_bytes(d: Path) -> None:
    _rewrite_header(d / MODEL, lambda hdr: hdr[FC1].update(dtype="I32"))


def _delete_shard(d: Path) -> None:
    (d / OPTIM).unlink()


def _edit_manifest(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        m = json.loads((d / "manifest.json").read_text())
        edit(m)
        (d / "manifest.json").write_text(json.dumps(m))

    return apply


CASES: list[tuple[str, Callable[[Path], None], tuple[str, str, str | None], str]] = [
    ("flipped payload byte", _flip_payload_byte, (P.SHA256, MODEL, FC1), "bytes differ"),
    ("truncated by one byte", _truncate, (P.SIZE, MODEL, None), "bytes, the manifest says"),
    ("truncated: tensor named", _truncate, (P.HEADER, MODEL, LAST), "file truncated"),
    ("appended bytes", _append, (P.SIZE, MODEL, None), "bytes, the manifest says"),
    ("appended bytes: header view", _append, (P.HEADER, MODEL, None), "16 unindexed bytes at the end"),
    ("header over 100 MB", _huge_header_length, (P.HEADER, MODEL, None), "exceeds safetensors' 100000000-byte"),
    ("bad header JSON", _bad_header_json, (P.HEADER, MODEL, None), "not valid JSON"),
    ("overlapping offsets", _overlap_offsets, (P.HEADER, MODEL, QKV), "overlap tensor"),
    ("shape vs byte length", _shape_disagrees_with_bytes, (P.HEADER, MODEL, QKV), "needs 432 bytes"),
    ("dtype swapped", _dtype_swapped_same_bytes, (P.TENSOR_SET, MODEL, FC1), "file has int32[4, 16, 8]"),
    ("missing shard", _delete_shard, (P.MISSING_FILE, OPTIM, None), "missing; it held 1 tensor"),
    (
        "manifest sha256 edited",
        _edit_manifest(lambda m: m["files"][OPTIM].update(sha256="0" * 64)),
        (P.SHA256, OPTIM, None),
        "every tensor's bytes match",
    ),
    (
        "manifest tensor dropped",
        _edit_manifest(lambda m: m["tensors"].pop(QKV)),
        (P.TENSOR_SET, MODEL, QKV),
        "in the file but not listed",
    ),
    (
        "manifest tensor added",
        _edit_manifest(lambda m: m["tensors"].update(ghost={**m["tensors"][QKV]})),
        (P.TENSOR_SET, MODEL, "ghost"),
        "listed in the manifest but not in the file",
    ),
    (
        "manifest from the future",
        _edit_manifest(lambda m: m.update(format_version=99)),
        (P.MANIFEST, "manifest.json", None),
        "newer moectl",
    ),
    (
        "manifest step edited",
        _edit_manifest(lambda m: m.update(step=11)),
        (P.MANIFEST, "manifest.json", None),
        "does not match the folder name",
    ),
]


@pytest.mark.parametrize("mutate, expected, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_corruption_is_named_and_refused(
    tmp_path: Path, mutate: Callable[[Path], None], expected: tuple[str, str, str | None], words: str
) -> None:
    d = save_simple(tmp_path, 10)
    assert verify_checkpoint(d) == []
    if expected[2] == LAST:
        header, _ = read_header(d / expected[1])
        assert header is not None
        expected = (expected[0], expected[1], max(header.entries.values(), key=lambda e: e.end).name)
    mutate(d)
    problems = verify_checkpoint(d)
    hits = [p for p in problems if (p.kind, p.file, p.tensor) == expected]
    assert hits, f"expected {expected}, got {[str(p) for p in problems]}"
    assert any(words in p.message for p in hits), [str(p) for p in hits]
    if expected[2] != "ghost":  # a damaged record is reported once, not also as a missing tensor
        assert not any("not in the file" in p.message for p in problems), [str(p) for p in problems]
    with pytest.raises(CheckpointError, match="refusing to load") as err:
        open_checkpoint(tmp_path)
    assert expected[1] in str(err.value)  # the first problem names a file
    if len(problems) > 1:
        assert f"and {len(problems) - 1} more problem(s)" in str(err.value)


def test_manifest_that_is_not_json_is_refused(tmp_path: Path) -> None:
    d = save_simple(tmp_path, 10)
    (d / "manifest.json").write_text('{"format": "moectl-checkpoint", ')
    (problem,) = verify_checkpoint(d)
    assert (problem.kind, problem.file) == (P.MANIFEST, "manifest.json") and "not valid JSON" in problem.message
    with pytest.raises(CheckpointError, match="refusing to load"):
        open_checkpoint(d, verify=False)  # the manifest is checked even without verification


class _Payload:
    """Unpickling this creates `path`: the sentinel a code-execution bug would leave behind."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def test_pickle_payloads_are_reported_and_never_executed(tmp_path: Path) -> None:
    # Positive control: the payload does fire when unpickled, so its sentinel staying absent means something.
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Payload(control))).close()
    assert control.exists()

    sentinel = tmp_path / "SENTINEL"
    d = save_simple(tmp_path / "checkpoints", 10)
    (d / OPTIM).write_bytes(pickle.dumps({"state": _Payload(sentinel)}, protocol=4))  # at the optim path
    torch.save({"state": _Payload(sentinel)}, d / "optim-00000.pt")  # and beside it, torch.save's zip format
    problems = {(p.kind, p.file): p.message for p in verify_checkpoint(d)}
    assert (P.HEADER, OPTIM) in problems
    assert "pickle" in problems[(P.UNEXPECTED_FILE, OPTIM)] and "never loaded" in problems[(P.UNEXPECTED_FILE, OPTIM)]
    assert "pickle/torch.save file" in problems[(P.UNEXPECTED_FILE, "optim-00000.pt")]
    with pytest.raises(CheckpointError, match="refusing to load"):
        open_checkpoint(d)
    with open_checkpoint(d, verify=False) as ck:  # even unverified, reading it only ever parses safetensors
        assert ck.read(FC1).shape == (4, 16, 8)
        with pytest.raises(CheckpointError, match=f"{OPTIM} tensor .*cannot read it"):
            ck.read(f"{FC1}.exp_avg")
    assert not sentinel.exists()
