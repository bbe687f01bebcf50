"""Our own reading of a safetensors header, so every defect can be named by file and tensor.

The format (huggingface/safetensors README): 8 bytes little-endian u64 `N`, then `N` bytes of UTF-8
JSON starting with `{` (space padding allowed), then the data section. The JSON maps tensor names to
`{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the data section) plus an
optional `"__metadata__"` of string to string. safetensors itself refuses a header over 100 MB, duplicate
keys, byte lengths that disagree with dtype and shape, and a data section that is not indexed exactly
(no holes, no overlaps, no trailing bytes: its `test_json_attack` and `test_metadata_incomplete_buffer`).
It refuses those files too, but with one terse error and no tensor name; these checks name them. Only
the header is read here, never the payload, and nothing is ever unpickled.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt import problems as P
from ckpt.problems import Problem

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit

# safetensors dtype -> bits per element. Sub-byte types pack; the byte length must still be whole.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip

# safetensors dtype -> torch dtype name, for the types both sides know. The manifest records torch names.
TORCH_NAME: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
    "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32",
    "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64", "C64": "complex64",
}  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One tensor as the header describes it; offsets are absolute byte positions in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    """A parsed header: its tensors by name, and where the data section starts."""

    data_start: int
    entries: dict[str, Entry]
    metadata: dict[str, str] | None
    malformed: frozenset[str]  # tensors named in the header whose record is unusable (already reported)


def read_header(path: Path, label: str | None = None) -> tuple[Header | None, list[Problem]]:
    """Parse and check the header of the safetensors file `path`.

    Returns the header (None when it cannot be parsed at all) and every problem found, each naming
    `label` (default: the file name) and the tensor concerned where there is one.
    """
    label = label or path.name
    found: list[Problem] = []

    def bad(message: str, tensor: str | None = None) -> None:
        found.append(Problem(P.HEADER, label, tensor, message))

    size = path.stat().st_size
    if size < 8:
        bad(f"file is {size} bytes, too short for the 8-byte safetensors header length")
        return None, found
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES:
            bad(f"header length {n} bytes exceeds safetensors' {MAX_HEADER_BYTES}-byte limit")
            return None, found
        if 8 + n > size:
            bad(f"header length {n} bytes runs past the end of the file ({size} bytes): truncated or not safetensors")
            return None, found
        raw = f.read(n)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad(f"header is not UTF-8 ({e.reason} at byte {e.start})")
        return None, found
    if not text.startswith("{"):
        bad("header does not start with '{': not a safetensors file")
        return None, found
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except (ValueError, _Duplicate, RecursionError) as e:  # RecursionError: absurdly nested JSON
        bad(f"header is not valid JSON: {type(e).__name__ if isinstance(e, RecursionError) else e}")
        return None, found
    if not isinstance(obj, dict):
        bad("header JSON is not an object")
        return None, found

    metadata = obj.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        bad("__metadata__ must map strings to strings")
        metadata = None

    data_start = 8 + n
    entries: dict[str, Entry] = {}
    for name, info in obj.items():
        entry = _entry(name, info, data_start, bad)
        if entry is not None:
            entries[name] = entry
    _check_coverage(entries, data_start, size, bad)
    return Header(data_start, entries, metadata, frozenset(obj) - set(entries)), found


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last duplicate silently; safetensors refuses duplicates, and so do we.
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(f"duplicate key {k!r}")
        out[k] = v
    return out


def _entry(name: str, info: Any, data_start: int, bad: Any) -> Entry | None:
    """Check one tensor's record; None (and a problem) if it is malformed."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        bad("record must have exactly dtype, shape and data_offsets", name)
        return None
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPE_BITS:
        bad(f"unknown dtype {dtype!r}", name)
        return None
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        bad(f"shape {shape!r} is not a list of non-negative integers", name)
        return None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        bad(f"data_offsets {offsets!r} is not two non-negative integers", name)
        return None
    begin, end = offsets
    if end < begin:
        bad(f"data_offsets [{begin}, {end}] end before they begin", name)
        return None
    numel = 1
    for d in shape:
        numel *= d
    bits = numel * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        bad(f"{dtype}{shape} needs {bits / 8:g} bytes but data_offsets [{begin}, {end}] hold {end - begin}", name)
        return None
    return Entry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _is_uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_coverage(entries: dict[str, Entry], data_start: int, size: int, bad: Any) -> None:
    """The data section must be indexed exactly: no overlap, no hole, nothing past either end."""
    cursor, prev = data_start, None
    past: list[Entry] = []  # a truncated file: one problem for all the tensors it cut, not one each
    for e in sorted(entries.values(), key=lambda e: (e.start, e.end)):
        if e.start < cursor:
            bad(f"bytes [{e.start}, {e.end}) overlap tensor {prev.name!r} (ends at {cursor})", e.name)  # type: ignore[union-attr]
        elif e.start > cursor:
            bad(f"{e.start - cursor} unindexed bytes before this tensor (a hole at {cursor})", e.name)
        if e.end > size:
            past.append(e)
        if e.end >= cursor:
            cursor, prev = e.end, e
    if past:
        more = f" and {len(past) - 1} more tensor(s) after it" if len(past) > 1 else ""
        bad(f"ends at byte {past[0].end} but the file has {size} bytes{more}: file truncated", past[0].name)
    if cursor < size:
        last = f" after tensor {prev.name!r}" if prev else ""
        bad(f"{size - cursor} unindexed bytes at the end of the file{last}: appended data")
