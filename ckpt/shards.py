"""One shard file: tensors -> safetensors bytes -> fsynced file, with its sha256 and tensor index.

The file is serialised in memory (`safetensors.torch.save`) so the sha256s are computed over exactly the
bytes written, without reading them back. That costs one shard's size in host memory: callers size
shards accordingly (docs/checkpoint.md: "more shards as size requires").
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from ckpt.durable import write_file
from ckpt.st_header import TORCH_NAME


def prepare(tensors: Any, fname: str) -> dict[str, torch.Tensor]:
    """Check a shard's tensors and make them savable: CPU, contiguous, no two sharing bytes.

    safetensors refuses non-contiguous tensors and tensors sharing memory (its Python binding); a
    logical checkpoint stores every name's values on their own, so overlapping ones are copied.
    """
    if not isinstance(tensors, dict):
        raise TypeError(f"{fname}: tensors must be a dict of name -> Tensor, got {type(tensors).__name__}")
    out: dict[str, torch.Tensor] = {}
    spans: list[tuple[int, int, str]] = []
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name.startswith("__"):
            raise ValueError(f"{fname}: tensor name {name!r} must be a non-empty str not starting with '__'")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fname}: {name!r} is a {type(t).__name__}, not a Tensor")
        t = t.detach().to("cpu").contiguous()
        out[name] = t
        if t.numel():
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name))
    spans.sort()
    end = -1
    for start, stop, name in spans:
        if start < end:
            out[name] = out[name].clone()
        end = max(end, stop)
    return out


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write `tensors` (from `prepare`) to the new file `path` and fsync it.

    Returns the file record `{sha256, size}` and `{tensor: {file, dtype, shape, sha256}}`, the per-tensor
    hash being over that tensor's bytes in the file.
    """
    # "format": "pt" is the metadata transformers and safetensors' own loaders expect from PyTorch files.
    data = st_save(tensors, metadata={"format": "pt"})
    write_file(path, data)
    view = memoryview(data)
    (n,) = struct.unpack("<Q", view[:8])
    header = json.loads(bytes(view[8 : 8 + n]))
    records = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        records[name] = {
            "file": path.name,
            "dtype": TORCH_NAME[info["dtype"]],
            "shape": info["shape"],
            "sha256": hashlib.sha256(view[8 + n + begin : 8 + n + end]).hexdigest(),
        }
    return {"sha256": hashlib.sha256(view).hexdigest(), "size": len(data)}, records
