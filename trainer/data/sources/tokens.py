"""`tokens`: a flat binary file of token ids (nanoGPT's `train.bin`, llm.c's `.bin`), memory-mapped.

How the token dtype is decided, first match wins:
  1. an llm.c header: the file starts with 256 little-endian int32s whose first is magic 20240520
     (version 1: uint16 tokens) or 20240801 (version 7: uint32 tokens), and whose third is the token
     count, with the file exactly 1024 + count * itemsize bytes long. The tokens follow the header.
  2. a dtype suffix before `.bin` in the file name: `name.u8.bin`, `name.u16.bin`, `name.u32.bin`
     (or spelt out: `.uint8.bin`, `.uint16.bin`, `.uint32.bin`, `.int32.bin`).
  3. otherwise uint16, nanoGPT's convention (`np.memmap(..., dtype=np.uint16)`).
A raw uint32 file read as uint16 usually fails the vocab check (or looks like half zeros), so when a
tokenizer has more than 65,536 ids, name the file `*.u32.bin`.
"""

from __future__ import annotations

import os
import struct

import torch

from ..storage import TOKEN_DTYPES, map_file
from ..stream import TokenStream

LLMC_HEADER_BYTES = 256 * 4
LLMC_FORMATS = {(20240520, 1): torch.uint16, (20240801, 7): torch.uint32}
SUFFIXES = {"u8": "uint8", "u16": "uint16", "u32": "uint32"}


def _llmc_dtype(path: str) -> tuple[torch.dtype, int] | None:
    """The token dtype and count if `path` has a valid llm.c header, else None."""
    size = os.path.getsize(path)
    if size < LLMC_HEADER_BYTES:
        return None
    with open(path, "rb") as f:
        magic, version, count = struct.unpack("<3i", f.read(12))
    dtype = LLMC_FORMATS.get((magic, version))
    if dtype is None or size != LLMC_HEADER_BYTES + count * torch.empty((), dtype=dtype).element_size():
        return None
    return dtype, count


def suffix_dtype(path: str) -> torch.dtype | None:
    """The dtype named by a `.u16.bin`-style suffix of `path`, or None."""
    stem = os.path.basename(path)
    if stem.endswith(".bin"):
        stem = stem[: -len(".bin")]
    tag = stem.rsplit(".", 1)[-1] if "." in stem else ""
    name = SUFFIXES.get(tag, tag)
    return TOKEN_DTYPES.get(name)


def load_tokens(path: str) -> TokenStream:
    """Memory-map a flat token file; see the module docstring for how its dtype is chosen."""
    if os.path.isfile(path):
        header = _llmc_dtype(path)
        if header is not None:
            dtype, count = header
            tokens = map_file(path, dtype, offset=LLMC_HEADER_BYTES, count=count)
            return TokenStream(source="tokens", tokens=tokens, path=path, notes={"format": "llm.c"})
    dtype = suffix_dtype(path)
    origin = "suffix" if dtype is not None else "default"
    tokens = map_file(path, dtype or torch.uint16)
    return TokenStream(source="tokens", tokens=tokens, path=path, notes={"format": f"flat ({origin} dtype)"})
