"""`megatron`: Megatron-LM's indexed dataset (`<prefix>.bin` + `<prefix>.idx`), read directly.

`data.path` is the prefix (a path ending in `.bin` or `.idx` is accepted too; a folder is refused, naming the
prefixes in it); the `.idx` format is in `megatron_index.py`. The stream is every sequence in index order,
concatenated (documents are runs of sequences, so their order is kept; no separator is added, as Megatron's
own GPT dataset adds none: the tokenizer's EOD token is already in the data when `preprocess_data.py
--append-eod` was used). When the sequences lie back to back in the .bin (what the builder always writes) the
stream is a zero-copy memory map; otherwise the sequences are gathered into memory.

The `.bin` must be exactly what the index accounts for: sum(sequence lengths) x the index dtype's size,
with no sequence overlapping another. Megatron's builder always writes exactly that, so any other size means
the pair does not belong together: a `.bin` 2x or 4x too large (or small) is an index whose dtype code does
not match its data (the message says which dtype the `.bin` holds), anything else is trailing bytes or a
truncated file. `data.dtype`, when set, must equal the index's dtype.
"""

from __future__ import annotations

import os

import torch

from moectl.core.errors import DataError

from ..dtype_check import check_plausible, data_dtype
from ..storage import dtype_name, is_data_file, itemsize, map_file
from ..stream import TokenStream
from .megatron_index import MegatronIndex, prefix_paths, read_index

_REBUILD = "rebuild the pair (the .bin and .idx must come from one IndexedDatasetBuilder run)"


def _mismatched_dtype(width: int, size: int, need: int) -> str | None:
    """The dtype the .bin holds when its size is the index's byte count times (or over) 2 or 4, else None."""
    names = {1: "uint8", 2: "uint16", 4: "int32 or uint32", 8: "int64"}
    for ratio in (2, 4):
        if size == need * ratio and width * ratio in names:
            return names[width * ratio]
        if size * ratio == need and width % ratio == 0:
            return names[width // ratio]
    return None


def check_bin_size(bin_path: str, idx_path: str, index: MegatronIndex, tokens: int) -> None:
    """The .bin holds exactly `tokens` values of the index's dtype; otherwise a `DataError` naming both sizes."""
    width = itemsize(index.dtype)
    need, size = tokens * width, os.path.getsize(bin_path)
    if size == need:
        return
    what = (
        f"{bin_path}: {size:,} bytes, but {os.path.basename(idx_path)} accounts for {tokens:,} "
        f"{dtype_name(index.dtype)} tokens = {need:,} bytes"
    )
    real = _mismatched_dtype(width, size, need)
    if real is not None:
        raise DataError(
            f"{what}: the sizes differ by exactly {max(size, need) // min(size, need)}x, as when the .bin holds "
            f"{real} tokens under an index that says {dtype_name(index.dtype)}",
            "the index's dtype code does not match its .bin; " + _REBUILD,
        )
    if size > need:
        raise DataError(
            f"{what} ({size - need:,} bytes extra)",
            "the .bin has trailing bytes or belongs to another index; " + _REBUILD,
        )
    raise DataError(f"{what} ({need - size:,} bytes missing)", "the .bin is truncated; copy it again or " + _REBUILD)


def _check_pointers(bin_path: str, ptrs: torch.Tensor, ends: torch.Tensor, size: int) -> None:
    """Every sequence lies inside the file, and no two overlap (so together they tile it exactly)."""
    if (ptrs < 0).any() or int(ends.max()) > size:
        raise DataError(
            f"{bin_path}: the index points past the end of the file ({size:,} bytes)",
            "the .bin is truncated or belongs to another index; " + _REBUILD,
        )
    order = torch.argsort(ptrs)
    if (ptrs[order][1:] < ends[order][:-1]).any():
        raise DataError(f"{bin_path}: the index's sequences overlap in the .bin", "the index is corrupt; " + _REBUILD)


def _no_index(path: str, bin_path: str, idx_path: str) -> DataError:
    """Why there is no `<prefix>.idx` to read, in the user's terms: `data.path` named a folder (the loader had
    said "<folder>.idx: no such file"), or a `.bin` with no index (a flat token file, most likely)."""
    if os.path.isdir(path):
        try:
            prefixes = sorted(n[: -len(".idx")] for n in os.listdir(path) if n.endswith(".idx"))
        except OSError:  # a folder we may not list: say what is wrong without the listing
            prefixes = []
        here = (
            f" (here: {', '.join(os.path.join(path, p) for p in prefixes[:3])}{', ...' if len(prefixes) > 3 else ''})"
            if prefixes else " (it holds no .idx file)"
        )  # fmt: skip
        return DataError(
            f"{path}: a folder, not a Megatron prefix",
            f"set data.path to <folder>/<prefix> of a <prefix>.bin/<prefix>.idx pair{here}",
        )
    if is_data_file(bin_path):
        return DataError(
            f"{idx_path}: no such file, so {os.path.basename(bin_path)} has no Megatron index",
            "copy its .idx next to it; a flat token file with no index is data.source: tokens",
        )
    return DataError(
        f"{idx_path}: no such file", "data.path is the prefix of a Megatron <prefix>.bin/<prefix>.idx pair"
    )


def load_megatron(path: str, dtype: str | None = None) -> TokenStream:
    """Read a Megatron `.bin`/`.idx` pair as one stream of all sequences in index order.

    Args:
        path: the prefix (or `<prefix>.bin` / `<prefix>.idx`).
        dtype: `data.dtype`; when set it must equal the index's dtype (the index decides how to read the .bin).
    """
    bin_path, idx_path = prefix_paths(path)
    if not is_data_file(idx_path):
        raise _no_index(path, bin_path, idx_path)
    index = read_index(idx_path)
    if dtype is not None and data_dtype(dtype) != index.dtype:
        raise DataError(
            f"{idx_path}: the index says {dtype_name(index.dtype)} tokens but data.dtype={dtype}",
            f"set data.dtype: {dtype_name(index.dtype)} (or null: the index decides), or rebuild the dataset "
            f"as {dtype}",
        )
    if not is_data_file(bin_path):
        raise DataError(f"{bin_path}: no such file (its index {idx_path} exists)", "copy the .bin next to the .idx")
    lengths = index.sequence_lengths.to(torch.int64)
    total = int(lengths.sum()) if lengths.numel() else 0
    notes = {"sequences": lengths.numel(), "documents": index.num_documents}
    if (lengths < 0).any():
        raise DataError(f"{idx_path}: negative sequence lengths", "the index is corrupt; " + _REBUILD)
    if total == 0:
        raise DataError(f"{idx_path}: the dataset has no tokens", "point data.path at a non-empty dataset")
    check_bin_size(bin_path, idx_path, index, total)
    width = itemsize(index.dtype)
    ptrs = index.sequence_pointers
    ends = ptrs + lengths * width
    _check_pointers(bin_path, ptrs, ends, total * width)
    first = int(ptrs[0])
    expected = first + torch.cumsum(lengths * width, 0) - lengths * width
    if first % width == 0 and torch.equal(ptrs, expected):
        tokens = map_file(bin_path, index.dtype, offset=first, count=total)
    else:
        whole = map_file(bin_path, torch.uint8)
        parts = [whole[int(p) : int(e)] for p, e in zip(ptrs.tolist(), ends.tolist())]
        tokens = torch.cat(parts).view(index.dtype)
    check_plausible(tokens, where=bin_path, dtype_from=f"the dtype {os.path.basename(idx_path)} names",
                    fix="the index's dtype code is wrong (the .bin holds {wider}); " + _REBUILD)
    return TokenStream(source="megatron", tokens=tokens, path=bin_path, notes=notes)
