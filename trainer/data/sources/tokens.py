"""`tokens`: a flat binary file of token ids (nanoGPT's `train.bin`, llm.c's `.bin`), memory-mapped.

How the token dtype is decided, first match wins:
  1. an llm.c header: the file starts with 256 little-endian int32s whose first is magic 20240520
     (version 1: uint16 tokens) or 20240801 (version 7: uint32 tokens), and whose third is the token
     count. The tokens follow the header, and the file must be exactly 1024 + count * itemsize bytes:
     a file with a known magic and any other size is refused, naming both sizes (never read as raw ids).
  2. `data.dtype` (uint8, uint16, int32, uint32), when set.
  3. a dtype suffix before `.bin` in the file name: `name.u8.bin`, `name.u16.bin`, `name.u32.bin`
     (or spelt out: `.uint8.bin`, `.uint16.bin`, `.uint32.bin`, `.int32.bin`).
  4. otherwise uint16, nanoGPT's convention (`np.memmap(..., dtype=np.uint16)`).
`data.dtype` that disagrees with an llm.c header or with the file's suffix is refused (which one is right
is for the user to say). Whatever decided it, the file's size must be a whole number of tokens, and the
bytes must look like tokens of that dtype: a uint32 file read as uint16 has a zero (or tiny) value in every
other position, and is refused naming the dtype it holds (see `trainer/data/dtype_check.py`).
"""

from __future__ import annotations

import os
import struct

import torch

from moectl.core.errors import DataError

from ..dtype_check import check_plausible, data_dtype
from ..storage import TOKEN_DTYPES, dtype_name, is_data_file, itemsize, map_file, open_data
from ..stream import TokenStream

LLMC_HEADER_BYTES = 256 * 4
LLMC_MAGICS = {20240520: "v1", 20240801: "v7"}
LLMC_FORMATS = {(20240520, 1): torch.uint16, (20240801, 7): torch.uint32}
SUFFIXES = {"u8": "uint8", "u16": "uint16", "u32": "uint32"}


def llmc_header(path: str) -> tuple[torch.dtype, int] | None:
    """The token dtype and count if `path` starts with an llm.c header, else None.

    A known magic with an unknown version, or with a file size other than the header promises, is a
    `DataError`: such a file is an llm.c file gone wrong, and reading it as raw ids would train on its header.
    """
    size = os.path.getsize(path)
    if size < 12:
        return None
    with open_data(path) as f:
        magic, version, count = struct.unpack("<3i", f.read(12))
    if magic not in LLMC_MAGICS:
        return None
    dtype = LLMC_FORMATS.get((magic, version))
    if dtype is None:
        known = ", ".join(f"{m} version {v}" for m, v in LLMC_FORMATS)
        raise DataError(
            f"{path}: llm.c magic {magic} with version {version}, which is not a known llm.c format ({known})",
            "rewrite the file with llm.c's current data scripts, or strip the header and set data.dtype",
        )
    need = LLMC_HEADER_BYTES + count * itemsize(dtype)
    if size != need:
        raise DataError(
            f"{path}: {size:,} bytes, but its llm.c header promises {count:,} {dtype_name(dtype)} tokens "
            f"= {need:,} bytes ({LLMC_HEADER_BYTES} header + {count:,} x {itemsize(dtype)})",
            "the file is truncated or has trailing bytes; rewrite it",
        )
    return dtype, count


def suffix_dtype(path: str) -> torch.dtype | None:
    """The dtype named by a `.u16.bin`-style suffix of `path`, or None."""
    stem = os.path.basename(path)
    if stem.endswith(".bin"):
        stem = stem[: -len(".bin")]
    tag = stem.rsplit(".", 1)[-1] if "." in stem else ""
    name = SUFFIXES.get(tag, tag)
    return TOKEN_DTYPES.get(name)


def _check_agrees(path: str, wanted: torch.dtype | None, found: torch.dtype, where: str,
                  renamable: bool = False) -> None:  # fmt: skip
    """`data.dtype`, when set, must be what the header or suffix says (`renamable`: a suffix, which a rename
    fixes; a header is not)."""
    if wanted is not None and wanted != found:
        raise DataError(
            f"{path}: data.dtype={dtype_name(wanted)} but {where} says {dtype_name(found)}",
            f"set data.dtype: {dtype_name(found)} (or null)" + (f", or rename the file if {where} is wrong"
                                                                if renamable else ""),  # fmt: skip
        )


def load_tokens(path: str, dtype: str | None = None) -> TokenStream:
    """Memory-map a flat token file; see the module docstring for how its dtype is chosen and checked.

    Args:
        path: the file.
        dtype: `data.dtype` (a key of `DATA_DTYPES`), or None to take it from the header, suffix or default.
    """
    wanted = data_dtype(dtype) if dtype is not None else None
    if is_data_file(path):
        header = llmc_header(path)
        if header is not None:
            found, count = header
            _check_agrees(path, wanted, found, "its llm.c header")
            tokens = map_file(path, found, offset=LLMC_HEADER_BYTES, count=count)
            fix = "the llm.c header names the wrong version; rewrite the file as {wider} (llm.c version 7)"
            check_plausible(tokens, where=path, dtype_from="its llm.c header", fix=fix)
            notes = {"format": "llm.c", "dtype_from": "header"}
            return TokenStream(source="tokens", tokens=tokens, path=path, notes=notes)
    named = suffix_dtype(path)
    if named is not None:
        _check_agrees(path, wanted, named, "its file name suffix", renamable=True)
    if wanted is not None:
        chosen, origin, fix = wanted, "data.dtype", "set data.dtype: {wider}"
    elif named is not None:
        chosen, origin, fix = named, "suffix", "rename the file: its dtype suffix is wrong, it holds {wider}"
    else:
        chosen, origin, fix = torch.uint16, "default", "set data.dtype: {wider}"
    tokens = map_file(path, chosen)
    said = {"data.dtype": "data.dtype", "suffix": "its file name suffix", "default": "no dtype given: the default"}
    check_plausible(tokens, where=path, dtype_from=said[origin], fix=fix)
    return TokenStream(source="tokens", tokens=tokens, path=path, notes={"format": "flat", "dtype_from": origin})
