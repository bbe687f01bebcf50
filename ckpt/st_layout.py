"""Where every byte of a safetensors file goes, decided before any byte is written.

The file is `u64 header length | header JSON | tensor data`, with the data in the order safetensors'
own serializer uses (huggingface/safetensors, `tensor::prepare`): dtypes from the widest-ranked down (the
order of its `Dtype` enum, reversed), names ascending within a dtype; the header is compact JSON with
`__metadata__` first and padded with spaces so the data starts 8-byte aligned. Laying it out here,
instead of serialising with `safetensors.torch.save`, lets the writer stream each tensor's own memory to
disk and hash it in parallel, without first building the whole file as one bytes object in memory (a copy
of the shard). The bytes are identical to what `safetensors.torch.save` returns (tested, every dtype the
format records), so files written before and after this module are indistinguishable.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

from ckpt.st_header import TORCH_NAME

# safetensors' `Dtype` enum order (its derive(Ord)); the data section is sorted by it, descending.
# Only the dtypes a moectl checkpoint can record (ckpt.st_header.TORCH_NAME) are listed.
_ENUM_ORDER = (
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
    "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)  # fmt: skip
_RANK = {name: i for i, name in enumerate(_ENUM_ORDER)}
_ST_NAME = {getattr(torch, v): k for k, v in TORCH_NAME.items()}  # torch dtype -> safetensors dtype
_ALIGN = 8


@dataclass(frozen=True)
class Placed:
    """One tensor's place in the file: absolute byte offsets [start, end)."""

    name: str
    tensor: torch.Tensor
    start: int
    end: int


@dataclass(frozen=True)
class Layout:
    """A whole file: its header bytes (length prefix included) and every tensor's place, in file order."""

    header: bytes
    placed: list[Placed]
    size: int


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (ValueError naming it when a checkpoint cannot record it)."""
    try:
        return _ST_NAME[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be saved: a checkpoint records only {sorted(_RANK)}") from None


def layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Layout:
    """The layout of a safetensors file holding `tensors` (contiguous CPU tensors), byte for byte as
    `safetensors.torch.save(tensors, metadata=metadata)` would write it."""
    order = sorted(tensors, key=lambda n: (-_RANK[st_dtype(tensors[n].dtype)], n))
    index: dict[str, object] = {}
    if metadata is not None:
        index["__metadata__"] = metadata
    offset = 0
    spans = []
    for name in order:
        t = tensors[name]
        n = t.numel() * t.element_size()
        index[name] = {"dtype": st_dtype(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        spans.append((name, offset, offset + n))
        offset += n
    # serde_json's compact form; non-ASCII stays UTF-8 and control characters are escaped as JSON requires
    text = json.dumps(index, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(len(text) + 8) % _ALIGN)
    header = struct.pack("<Q", len(text)) + text
    base = len(header)
    placed = [Placed(name, tensors[name], base + a, base + b) for name, a, b in spans]
    return Layout(header, placed, base + offset)
