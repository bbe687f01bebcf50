"""Our safetensors header checks on hand-made files: each defect safetensors' own tests cover is named."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from ckpt.st_header import read_header


def _write(tmp_path: Path, header: str | bytes, payload: int) -> Path:
    raw = header.encode() if isinstance(header, str) else header
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00" * payload)
    return path


def _rec(dtype: str, shape: list[int], b: int, e: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [b, e]}


def test_a_file_safetensors_wrote_is_clean(tmp_path: Path) -> None:
    path = tmp_path / "ok.safetensors"
    path.write_bytes(save({"a": torch.ones(3, 2), "b": torch.zeros(0), "c": torch.ones(5, dtype=torch.uint8)}, {"k": "v"}))
    header, problems = read_header(path)
    assert problems == [] and header is not None
    assert set(header.entries) == {"a", "b", "c"} and header.metadata == {"k": "v"} and not header.malformed


CASES = [
    ("tiny", b"\x01\x02\x03", None, "too short"),
    ("not json", "{nope", None, "not valid JSON"),
    ("not an object start", "[1, 2]", None, "does not start with '{'"),
    ("not utf-8", b"{\xff\xfe}", None, "not UTF-8"),
    ("duplicate key", '{"a": %s, "a": %s}' % (json.dumps(_rec("U8", [1], 0, 1)), json.dumps(_rec("U8", [1], 1, 2))),
     None, "duplicate key 'a'"),
    ("unknown dtype", json.dumps({"a": _rec("F7", [1], 0, 1)}), "a", "unknown dtype 'F7'"),
    ("negative shape", json.dumps({"a": _rec("U8", [-1], 0, 1)}), "a", "not a list of non-negative"),
    ("reversed offsets", json.dumps({"a": _rec("U8", [0], 2, 1)}), "a", "end before they begin"),
    ("missing field", json.dumps({"a": {"dtype": "U8", "shape": [1]}}), "a", "exactly dtype, shape and data_offsets"),
    ("byte length", json.dumps({"a": _rec("F32", [2], 0, 4)}), "a", "needs 8 bytes"),
    ("hole", json.dumps({"a": _rec("U8", [1], 0, 1), "b": _rec("U8", [1], 2, 3)}), "b", "1 unindexed bytes before"),
    ("nested too deep", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", None, "RecursionError"),
    ("bad metadata", json.dumps({"__metadata__": {"k": 1}, "a": _rec("U8", [1], 0, 1)}), None, "map strings to strings"),
]  # fmt: skip


@pytest.mark.parametrize("header, tensor, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_header_defects_are_named(tmp_path: Path, header: str | bytes, tensor: str | None, words: str) -> None:
    if isinstance(header, bytes) and len(header) < 8 and not header.startswith(b"{"):
        path = tmp_path / "x.safetensors"
        path.write_bytes(header)
    else:
        path = _write(tmp_path, header, payload=3)
    _, problems = read_header(path)
    assert any(p.tensor == tensor and words in p.message for p in problems), [str(p) for p in problems]
    assert all(p.file == "x.safetensors" for p in problems)


def test_a_malformed_record_is_not_also_reported_missing(tmp_path: Path) -> None:
    path = _write(tmp_path, json.dumps({"a": _rec("F32", [2], 0, 4)}), payload=4)
    header, problems = read_header(path)
    assert header is not None and header.malformed == {"a"} and len(problems) == 2  # byte length + hole at end


def test_a_truncated_file_is_one_problem_naming_the_first_tensor_it_cut(tmp_path: Path) -> None:
    records = {f"t{i}": _rec("U8", [4], 4 * i, 4 * i + 4) for i in range(50)}
    path = _write(tmp_path, json.dumps(records), payload=4 * 10 + 2)  # t10 is cut, t11..t49 are gone
    _, problems = read_header(path)
    assert [(p.tensor, p.message) for p in problems] == [
        ("t10", f"ends at byte {8 + len(json.dumps(records)) + 44} but the file has "
                f"{8 + len(json.dumps(records)) + 42} bytes and 39 more tensor(s) after it: file truncated")]
