"""Token storage on disk and in memory: mapping files as tensors, hashing and scanning them.

Everything here is plain torch plus the standard library. numpy is deliberately not used: it is not a
declared dependency of moectl and torch does not pull it in, so a clean install may not have it.

Files are mapped with `mmap.ACCESS_COPY` (a private, copy-on-write mapping): `torch.frombuffer` wants a
writable buffer, and we never write, so pages stay shared with the page cache and a 50 GB token file costs
no resident memory until a window is read. All on-disk formats we read are little-endian.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

import torch

from moectl.core.errors import DataError

#: The integer dtypes a token stream may be stored in, by the names used in file suffixes and docs.
TOKEN_DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "uint16": torch.uint16,
    "int32": torch.int32,
    "uint32": torch.uint32,
    "int64": torch.int64,
}

# Hashing a stream larger than this would stall every start-up (about 1 s per GB); above it the
# fingerprint covers the length plus the first and last SAMPLE_BYTES, and says so.
FULL_HASH_LIMIT = 1 << 30
SAMPLE_BYTES = 64 << 20
# Chunk for scans over huge streams, so no scan materialises more than this many int64 values.
SCAN_CHUNK = 1 << 24


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.uint16` -> `"uint16"`."""
    return str(dtype).removeprefix("torch.")


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per value of `dtype` (`torch.uint16` -> 2)."""
    return torch.empty((), dtype=dtype).element_size()


def unreadable(path: str, err: OSError) -> DataError:
    """The `DataError` for a data file the OS will not let us stat, open, read or map, naming its reason."""
    if isinstance(err, PermissionError):
        fix = "make it readable by this user (chmod a+r, and a+x on its folders), or point data.path at a readable copy"
    else:
        fix = "check the file and the disk it is on, or point data.path at a readable copy"
    return DataError(f"{path}: cannot be read ({err.strerror or err})", fix)


def is_data_file(path: str) -> bool:
    """`os.path.isfile(path)`, except that a path the OS will not let us look at is a `DataError` naming the
    reason: `isfile` says False for a file in a folder this user may not search, which reads as "no such file"."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: a NUL in the path, as isfile
        return False
    except OSError as e:
        raise unreadable(path, e) from None


def require_file(path: str) -> None:
    """A `DataError` unless `path` is a file (saying whether it is missing, a folder, or unreadable)."""
    if not is_data_file(path):
        what = "a folder, not a data file" if os.path.isdir(path) else "no such file"
        raise DataError(f"{path}: {what}", "check data.path (it names one file)")


@contextmanager
def open_data(path: str, *, text: bool = False) -> Iterator[IO[Any]]:
    """`path` opened for reading, as bytes or as UTF-8 text. Every data file is opened here, so that an `OSError`
    while opening, reading or mapping it (permission denied, an I/O error) is a `DataError` naming the file and
    the OS reason, as a missing file is, and never a traceback."""
    try:
        with open(path, "r" if text else "rb", encoding="utf-8" if text else None) as f:
            yield f
    except OSError as e:
        raise unreadable(path, e) from None


#: the token dtypes `data.dtype` names, with their widths (trainer/data/dtype_check.py DATA_DTYPES)
_DTYPE_WIDTHS = (("uint8", 1), ("uint16", 2), ("int32", 4), ("uint32", 4))


def map_file(path: str, dtype: torch.dtype, *, offset: int = 0, count: int | None = None) -> torch.Tensor:
    """Map `count` items of `dtype` starting at byte `offset` of `path` as a read-only-in-practice 1-D tensor.

    `count=None` maps everything after `offset`, which must then be a whole number of items.
    Raises `DataError` for a missing, unreadable or empty file or a size that does not fit the dtype.
    """
    if sys.byteorder != "little":  # pragma: no cover - every supported accelerator host is little-endian
        raise DataError(f"{path}: token files are little-endian and this host is not", "run on a little-endian host")
    require_file(path)
    size = os.path.getsize(path)
    width = itemsize(dtype)
    if count is None:
        if (size - offset) % width:
            whole = [name for name, w in _DTYPE_WIDTHS if (size - offset) % w == 0]  # uint8 always
            raise DataError(
                f"{path}: {size - offset:,} bytes of tokens is not a whole number of {dtype_name(dtype)} values "
                f"({width} bytes each)",
                f"set data.dtype to the dtype the file was written with (whole at this size: {', '.join(whole)}; "
                f"e.g. --set data.dtype={whole[-1]}), or rebuild a truncated file",
            )
        count = (size - offset) // width
    if count <= 0:
        raise DataError(f"{path}: no tokens in the file", "point data.path at a non-empty token file")
    if offset + count * width > size:
        raise DataError(
            f"{path}: needs {offset + count * width:,} bytes but the file has {size:,}",
            "the file is truncated or does not match its index/header; rebuild it",
        )
    with open_data(path) as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    # The tensor keeps `mapped` alive; the file descriptor is no longer needed once mapped.
    return torch.frombuffer(mapped, dtype=dtype, offset=offset, count=count)


def raw_bytes(t: torch.Tensor, start: int = 0, length: int | None = None) -> bytes:
    """A copy of bytes [start, start+length) of a contiguous CPU tensor's storage (no numpy needed)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("raw_bytes needs a contiguous CPU tensor")
    total = t.numel() * t.element_size()
    length = total - start if length is None else min(length, total - start)
    return ctypes.string_at(t.data_ptr() + start, length) if length > 0 else b""


@dataclass(frozen=True)
class Fingerprint:
    """A stream's sha256 over its raw bytes (in storage dtype), and whether it covers every byte."""

    sha256: str
    full: bool

    def short(self) -> str:
        """`sha256:1a2b3c4d5e6f`, or `sha256(sampled):...` when only head, tail and length were hashed."""
        return f"sha256{'' if self.full else '(sampled)'}:{self.sha256[:12]}"


def fingerprint(t: torch.Tensor) -> Fingerprint:
    """sha256 of the tensor's bytes; for streams over 1 GiB, of its length, first and last 64 MiB."""
    total = t.numel() * t.element_size()
    h = hashlib.sha256()
    if total <= FULL_HASH_LIMIT:
        for start in range(0, total, SAMPLE_BYTES):
            h.update(raw_bytes(t, start, SAMPLE_BYTES))
        return Fingerprint(h.hexdigest(), full=True)
    h.update(total.to_bytes(8, "little"))
    h.update(raw_bytes(t, 0, SAMPLE_BYTES))
    h.update(raw_bytes(t, total - SAMPLE_BYTES, SAMPLE_BYTES))
    return Fingerprint(h.hexdigest(), full=False)


def max_token(t: torch.Tensor) -> int:
    """The largest value in a 1-D integer tensor, chunked (torch has no max() for uint16/uint32)."""
    best = None
    for start in range(0, t.numel(), SCAN_CHUNK):
        m = int(t[start : start + SCAN_CHUNK].to(torch.int64).max())
        best = m if best is None else max(best, m)
    if best is None:
        raise ValueError("max_token of an empty stream")
    return best


def min_token(t: torch.Tensor) -> int:
    """The smallest value in a 1-D integer tensor, chunked (signed storage could hold negative ids)."""
    return min(int(t[s : s + SCAN_CHUNK].to(torch.int64).min()) for s in range(0, t.numel(), SCAN_CHUNK))
