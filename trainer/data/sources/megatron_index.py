"""The Megatron `.idx` file: parse it, and check that its size is exactly what its header promises.

The layout, all little-endian, as written by Megatron-Core's `IndexedDatasetBuilder`
(megatron/core/datasets/indexed_dataset.py, `_IndexWriter`):

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          u64       1
    dtype code       u8        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count   u64       S
    document count   u64       D = len(document_indices); this list starts with 0, so D-1 documents
    sequence lengths int32[S]  tokens per sequence
    sequence ptrs    int64[S]  byte offset of each sequence in the .bin
    document indices int64[D]  sequence index where each document starts; the last one equals S
    (sequence modes  int8[S]   multimodal datasets only; ignored here)

So an index is exactly `34 + 12*S + 8*D` bytes, or `S` more with modes; any other size is refused.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import torch

from moectl.core.errors import DataError
from moectl.core.facts import megatron_prefix_paths as prefix_paths  # noqa: F401 - the loader's name for it

from ..storage import is_data_file, map_file, open_data

MAGIC = b"MMIDIDX\x00\x00"
# Megatron's dtype codes. The float codes exist in the format but cannot hold token ids.
DTYPE_CODES: dict[int, torch.dtype | None] = {
    1: torch.uint8,
    2: torch.int8,
    3: torch.int16,
    4: torch.int32,
    5: torch.int64,
    6: None,  # float64
    7: None,  # float32
    8: torch.uint16,
}
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
_REBUILD = "rebuild the dataset (Megatron's preprocess_data.py, or IndexedDatasetBuilder)"


@dataclass(frozen=True)
class MegatronIndex:
    """A parsed `.idx` file."""

    dtype: torch.dtype
    sequence_lengths: torch.Tensor  # int32 [S]
    sequence_pointers: torch.Tensor  # int64 [S], byte offsets into the .bin
    document_indices: torch.Tensor  # int64 [D]

    @property
    def num_documents(self) -> int:
        """Documents in the dataset (the index list has a leading 0)."""
        return max(self.document_indices.numel() - 1, 0)


def _read_header(idx_path: str) -> tuple[int, int, int, int]:
    """`(version, dtype code, sequence count, document count)`; a short file is "truncated", not "bad magic"."""
    with open_data(idx_path) as f:
        raw = f.read(HEADER.size)
    if raw[: len(MAGIC)] != MAGIC[: len(raw)]:
        raise DataError(
            f"{idx_path}: not a Megatron index (bad magic {raw[:9]!r}, expected {MAGIC!r})",
            "point data.path at the prefix of files written by Megatron's preprocess_data.py",
        )
    if len(raw) < HEADER.size:
        raise DataError(
            f"{idx_path}: truncated ({len(raw)} bytes, shorter than the {HEADER.size}-byte header)", _REBUILD
        )
    _, version, code, n_seq, n_doc = HEADER.unpack_from(raw)
    return version, code, n_seq, n_doc


def _check_size(idx_path: str, n_seq: int, n_doc: int) -> None:
    """The file is exactly the header plus its arrays (plus one mode byte per sequence, if multimodal)."""
    need = HEADER.size + n_seq * 12 + n_doc * 8
    size = os.path.getsize(idx_path)
    if size < need:
        raise DataError(
            f"{idx_path}: truncated ({size:,} bytes, the header promises {need:,} for {n_seq:,} sequences "
            f"and {n_doc:,} document indices)",
            _REBUILD,
        )
    if size not in (need, need + n_seq):
        raise DataError(
            f"{idx_path}: {size:,} bytes, but the header accounts for {need:,} ({need + n_seq:,} with "
            f"multimodal modes): {size - need:,} bytes too many",
            "the index has trailing bytes or a corrupt header; " + _REBUILD,
        )


def read_index(idx_path: str) -> MegatronIndex:
    """Parse and check a Megatron `.idx` file; every problem is a `DataError` naming the file."""
    if not is_data_file(idx_path):
        raise DataError(
            f"{idx_path}: no such file", "data.path is the prefix of a Megatron <prefix>.bin/<prefix>.idx pair"
        )
    version, code, n_seq, n_doc = _read_header(idx_path)
    if version != 1:
        raise DataError(f"{idx_path}: index version {version} is not supported (only 1)", _REBUILD)
    if code not in DTYPE_CODES:
        raise DataError(f"{idx_path}: unknown dtype code {code}", _REBUILD)
    dtype = DTYPE_CODES[code]
    if dtype is None:
        raise DataError(f"{idx_path}: float tokens (dtype code {code}) cannot be token ids", "rebuild as integers")
    _check_size(idx_path, n_seq, n_doc)
    at = HEADER.size
    lengths = _array(idx_path, torch.int32, at, n_seq)
    pointers = _array(idx_path, torch.int64, at + n_seq * 4, n_seq)
    docs = _array(idx_path, torch.int64, at + n_seq * 12, n_doc)
    if n_doc and int(docs[-1]) != n_seq:
        raise DataError(
            f"{idx_path}: last document index {int(docs[-1])} != sequence count {n_seq}",
            "the index is corrupt; " + _REBUILD,
        )
    return MegatronIndex(dtype=dtype, sequence_lengths=lengths, sequence_pointers=pointers, document_indices=docs)


def _array(idx_path: str, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    """`count` values at byte `offset`, copied into aligned memory (the arrays start at odd offsets: 34 ...)."""
    if count == 0:  # an index may hold no documents; mmap views cannot be empty
        return torch.empty(0, dtype=dtype)
    return map_file(idx_path, dtype, offset=offset, count=count).clone()
