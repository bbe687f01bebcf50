"""`megatron`: Megatron-LM's indexed dataset (`<prefix>.bin` + `<prefix>.idx`), read directly.

`data.path` is the prefix (a path ending in `.bin` or `.idx` is accepted too). The `.idx` layout, all
little-endian, as written by Megatron's `IndexedDatasetBuilder` (megatron/core/datasets/indexed_dataset.py):

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          u64       1
    dtype code       u8        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count   u64       S
    document count   u64       D = len(document_indices); this list starts with 0, so D-1 documents
    sequence lengths int32[S]  tokens per sequence
    sequence ptrs    int64[S]  byte offset of each sequence in the .bin
    document indices int64[D]  sequence index where each document starts; the last one equals S
    (sequence modes  int8[S]   multimodal datasets only; ignored here)

The stream is every sequence in index order, concatenated (documents are runs of sequences, so their
order is kept; no separator is added, as Megatron's own GPT dataset adds none: the tokenizer's EOD token
is already in the data when `preprocess_data.py --append-eod` was used). When the sequences lie back to
back in the .bin (what the builder always writes) the stream is a zero-copy memory map; otherwise the
sequences are gathered into memory.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import torch

from moectl.core.errors import DataError

from ..storage import map_file
from ..stream import TokenStream

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
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count


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


def prefix_paths(path: str) -> tuple[str, str]:
    """`(bin_path, idx_path)` for a prefix, or for a path that already ends in `.bin`/`.idx`."""
    for ext in (".bin", ".idx"):
        if path.endswith(ext):
            path = path[: -len(ext)]
    return path + ".bin", path + ".idx"


def read_index(idx_path: str) -> MegatronIndex:
    """Parse and check a Megatron `.idx` file; every problem is a `DataError` naming the file."""
    if not os.path.isfile(idx_path):
        raise DataError(
            f"{idx_path}: no such file", "data.path is the prefix of a Megatron <prefix>.bin/<prefix>.idx pair"
        )
    with open(idx_path, "rb") as f:
        raw = f.read(_HEADER.size)
    if len(raw) < _HEADER.size or raw[:9] != MAGIC:
        raise DataError(
            f"{idx_path}: not a Megatron index (bad magic {raw[:9]!r}, expected {MAGIC!r})",
            "point data.path at the prefix of files written by Megatron's preprocess_data.py",
        )
    _, version, code, n_seq, n_doc = _HEADER.unpack_from(raw)
    if version != 1:
        raise DataError(f"{idx_path}: index version {version} is not supported (only 1)", "rebuild with Megatron-Core")
    if code not in DTYPE_CODES:
        raise DataError(f"{idx_path}: unknown dtype code {code}", "rebuild the dataset with Megatron-Core")
    dtype = DTYPE_CODES[code]
    if dtype is None:
        raise DataError(f"{idx_path}: float tokens (dtype code {code}) cannot be token ids", "rebuild as integers")
    need = _HEADER.size + n_seq * 4 + n_seq * 8 + n_doc * 8
    size = os.path.getsize(idx_path)
    if size < need:
        raise DataError(f"{idx_path}: truncated ({size} bytes, the header promises {need})", "rebuild the dataset")
    at = _HEADER.size
    lengths = _array(idx_path, torch.int32, at, n_seq)
    pointers = _array(idx_path, torch.int64, at + n_seq * 4, n_seq)
    docs = _array(idx_path, torch.int64, at + n_seq * 12, n_doc)
    if n_doc and int(docs[-1]) != n_seq:
        raise DataError(
            f"{idx_path}: last document index {int(docs[-1])} != sequence count {n_seq}",
            "the index is corrupt; rebuild the dataset",
        )
    return MegatronIndex(dtype=dtype, sequence_lengths=lengths, sequence_pointers=pointers, document_indices=docs)


def _array(idx_path: str, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    """`count` values at byte `offset`, copied into aligned memory (the arrays start at odd offsets: 34 ...)."""
    if count == 0:  # an index may hold no documents; mmap views cannot be empty
        return torch.empty(0, dtype=dtype)
    return map_file(idx_path, dtype, offset=offset, count=count).clone()


def load_megatron(path: str) -> TokenStream:
    """Read a Megatron `.bin`/`.idx` pair as one stream of all sequences in index order."""
    bin_path, idx_path = prefix_paths(path)
    index = read_index(idx_path)
    if not os.path.isfile(bin_path):
        raise DataError(f"{bin_path}: no such file (its index {idx_path} exists)", "copy the .bin next to the .idx")
    lengths = index.sequence_lengths.to(torch.int64)
    total = int(lengths.sum()) if lengths.numel() else 0
    notes = {"sequences": lengths.numel(), "documents": index.num_documents}
    if (lengths < 0).any():
        raise DataError(f"{idx_path}: negative sequence lengths", "the index is corrupt; rebuild the dataset")
    if total == 0:
        raise DataError(f"{idx_path}: the dataset has no tokens", "point data.path at a non-empty dataset")
    itemsize = torch.empty((), dtype=index.dtype).element_size()
    size = os.path.getsize(bin_path)
    ptrs = index.sequence_pointers
    ends = ptrs + lengths * itemsize
    if (ptrs < 0).any() or int(ends.max()) > size:
        raise DataError(
            f"{bin_path}: the index points past the end of the file ({size} bytes)",
            "the .bin is truncated or belongs to another index; rebuild the dataset",
        )
    first = int(ptrs[0])
    expected = first + torch.cumsum(lengths * itemsize, 0) - lengths * itemsize
    if first % itemsize == 0 and torch.equal(ptrs, expected):
        tokens = map_file(bin_path, index.dtype, offset=first, count=total)
    else:
        whole = map_file(bin_path, torch.uint8)
        parts = [whole[int(p) : int(e)] for p, e in zip(ptrs.tolist(), ends.tolist())]
        tokens = torch.cat(parts).view(index.dtype)
    return TokenStream(source="megatron", tokens=tokens, path=bin_path, notes=notes)
