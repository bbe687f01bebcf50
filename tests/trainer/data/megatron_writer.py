"""A byte-identical reimplementation of Megatron-Core's `IndexedDatasetBuilder`, for machines without it.

It follows megatron/core/datasets/indexed_dataset.py (Megatron-Core 0.16.1) call for call: `add_item`
writes one sequence's values to the .bin, `end_document` closes a document, `add_document` writes a whole
document, `add_index` appends another prefix (its .bin bytes copied, its lengths and document indices
shifted), and `finalize` writes the .idx through `_IndexWriter`: magic, version 1, the dtype code, the
sequence and document counts, int32 lengths, int64 byte pointers (running sums of length x itemsize,
recomputed from the lengths, so a merged index points into the merged .bin), int64 document indices.
`tests/trainer/data/test_megatron_interop.py` checks its output byte for byte against files that
Megatron-Core's own builder wrote (`fixtures/megatron/`), and against the builder itself when it installs.
Standard library only: no numpy, no torch.
"""

from __future__ import annotations

import struct
from array import array
from pathlib import Path

MAGIC = b"MMIDIDX\x00\x00"
#: Megatron's `DType` codes, with the `array` typecode that has the same little-endian layout.
CODES = {"uint8": (1, "B"), "int8": (2, "b"), "int16": (3, "h"), "int32": (4, "i"), "int64": (5, "q"), "uint16": (8, "H")}


class Builder:
    """`IndexedDatasetBuilder(bin_path, dtype)`; dtype is a name from `CODES` (numpy's names)."""

    def __init__(self, bin_path: str | Path, dtype: str = "int32") -> None:
        self.code, self.typecode = CODES[dtype]
        self.itemsize = array(self.typecode).itemsize
        self.data_file = open(bin_path, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, values: list[int]) -> None:
        """One sequence."""
        self.data_file.write(array(self.typecode, values).tobytes())
        self.sequence_lengths.append(len(values))

    def add_document(self, values: list[int], lengths: list[int]) -> None:
        """A whole document: its values, cut into sequences of `lengths`."""
        self.data_file.write(array(self.typecode, values).tobytes())
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def end_document(self) -> None:
        """Close the document that the last `add_item` calls made."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, prefix: str | Path) -> None:
        """Append the dataset at `prefix` (same dtype): its index entries, then its .bin bytes."""
        lengths, docs, code = read_index(f"{prefix}.idx")
        assert code == self.code, "add_index needs the same dtype"
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(lengths)
        self.document_indices.extend(offset + d for d in docs[1:])
        self.data_file.write(Path(f"{prefix}.bin").read_bytes())

    def finalize(self, idx_path: str | Path) -> None:
        """Close the .bin and write the .idx."""
        self.data_file.close()
        pointers, at = [], 0
        for length in self.sequence_lengths:
            pointers.append(at)
            at += length * self.itemsize
        with open(idx_path, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", 1) + struct.pack("<B", self.code))
            f.write(struct.pack("<Q", len(self.sequence_lengths)) + struct.pack("<Q", len(self.document_indices)))
            f.write(array("i", self.sequence_lengths).tobytes())
            f.write(array("q", pointers).tobytes())
            f.write(array("q", self.document_indices).tobytes())


def read_index(idx_path: str | Path) -> tuple[list[int], list[int], int]:
    """`(sequence lengths, document indices, dtype code)` of an index (for `add_index`)."""
    raw = Path(idx_path).read_bytes()
    _, _, code, n_seq, n_doc = struct.unpack_from("<9sQBQQ", raw)
    at = 34
    lengths = array("i", raw[at : at + 4 * n_seq]).tolist()
    docs = array("q", raw[at + 12 * n_seq : at + 12 * n_seq + 8 * n_doc]).tolist()
    return lengths, docs, code
