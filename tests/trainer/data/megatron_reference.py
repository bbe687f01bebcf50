"""The Megatron datasets the interop tests use, and the script that builds them with Megatron-Core itself.

`CASES` lists each dataset as builder calls (pure data). Run as a script, this file replays them through
Megatron-Core's own `IndexedDatasetBuilder` into a folder, then reads each dataset back with Megatron-Core's
`IndexedDataset` and writes every sequence, concatenated in index order, as `<name>.tokens` (int64,
little-endian): what Megatron itself says the dataset holds.

    python3 tests/trainer/data/megatron_reference.py OUT_DIR

`fixtures/megatron/` holds the .bin/.idx pairs this wrote with Megatron-Core 0.16.1 (the wheel
megatron_core-0.16.1-cp311, `pip install --no-deps megatron-core==0.16.1`, numpy 2.4, torch 2.13 CPU):
the reference that `megatron_writer.Builder` is checked against byte for byte where Megatron-Core does not
install. The tests also run this script live when Megatron-Core is importable.
"""

from __future__ import annotations

import sys
from array import array
from pathlib import Path


def _ids(seed: int, n: int, high: int) -> list[int]:
    """`n` ids in [0, high) from a 64-bit LCG (Knuth's MMIX constants): the same on every machine."""
    out, x = [], seed
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append((x >> 33) % high)
    return out


TEXT = list(b"Megatron and moectl read the same tokens.\n")
#: name -> (dtype, ops); an op is ("item", ids) | ("end",) | ("document", ids, lengths) | ("index", name).
CASES: dict[str, tuple[str, list[tuple]]] = {
    "u16_docs": ("uint16", [
        ("item", _ids(1, 40, 50257)), ("item", _ids(2, 7, 50257)), ("item", [0, 65535, 1]), ("end",),
        ("item", _ids(3, 25, 50257)), ("end",),
        ("item", _ids(4, 1, 50257)), ("item", _ids(5, 30, 50257)), ("end",),
    ]),
    "i32_docs": ("int32", [
        ("document", _ids(6, 48, 151936), [16, 32]),
        ("document", _ids(7, 20, 151936) + [151935, 0], [22]),
    ]),
    "u8_text": ("uint8", [("item", TEXT[:20]), ("item", TEXT[20:]), ("end",), ("item", TEXT), ("end",)]),
    "u16_tail": ("uint16", [("item", _ids(8, 12, 50257)), ("end",)]),
    "u16_merged": ("uint16", [
        ("index", "u16_docs"), ("item", _ids(9, 5, 50257)), ("end",), ("index", "u16_tail"),
    ]),
}


def expected_tokens(name: str) -> list[int]:
    """Every id of dataset `name`, in index order (what a reader must return)."""
    out: list[int] = []
    for op in CASES[name][1]:
        if op[0] in ("item", "document"):
            out += op[1]
        elif op[0] == "index":
            out += expected_tokens(op[1])
    return out


def build(out: Path, builder_class, make_values) -> None:  # noqa: ANN001 - either builder
    """Replay `CASES` through `builder_class(bin_path, dtype)`; `make_values(ids, dtype)` makes its input."""
    for name, (dtype, ops) in CASES.items():  # dict order: merged cases come after their parts
        builder = builder_class(str(out / f"{name}.bin"), dtype)
        for op in ops:
            if op[0] == "item":
                builder.add_item(make_values(op[1], dtype))
            elif op[0] == "end":
                builder.end_document()
            elif op[0] == "document":
                builder.add_document(make_values(op[1], dtype), op[2])
            else:
                builder.add_index(str(out / op[1]))
        builder.finalize(str(out / f"{name}.idx"))


def main(out: Path) -> None:
    """Build every case with Megatron-Core and write what its reader returns."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    out.mkdir(parents=True, exist_ok=True)
    build(
        out,
        lambda path, dtype: IndexedDatasetBuilder(path, dtype=getattr(numpy, dtype)),
        lambda ids, dtype: torch.tensor(ids, dtype=torch.int64),
    )
    for name in CASES:
        ds = IndexedDataset(str(out / name))
        seqs = [ds[i].astype(numpy.int64) for i in range(len(ds))]
        (out / f"{name}.tokens").write_bytes(array("q", numpy.concatenate(seqs).tolist()).tobytes())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
