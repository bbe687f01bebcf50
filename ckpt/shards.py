"""One shard file: tensors -> safetensors file, with its digest (`ckpt.digest`) and tensor index.

The bytes are those `safetensors.torch.save` produces (`ckpt.st_layout` places them), written straight
from the tensors' memory by `ckpt.shard_io`, which hashes the same memory in parallel: the sha256s are of
exactly the bytes written, without reading them back and without a serialised copy of the shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ckpt.shard_io import write_layout
from ckpt.st_header import TORCH_NAME
from ckpt.st_layout import layout, st_dtype


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
        # A dtype or layout the format cannot record fails here, naming the tensor, before any file is written.
        if t.layout != torch.strided:
            raise ValueError(f"{fname}: {name!r} is a {t.layout} tensor; a checkpoint holds dense tensors only")
        try:
            st_dtype(t.dtype)
        except ValueError as e:
            raise ValueError(f"{fname}: {name!r}: {e}") from None
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


def write_shard(path: Path, tensors: dict[str, torch.Tensor], threads: int | None = None,
                fsync: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write `tensors` (from `prepare`) to the new file `path` and fsync it (unless `fsync` is False: then
    the caller must, before anything refers to the file).

    Returns the file record `{sha256, size}` (`sha256`: the file's tree digest, `ckpt.digest`) and
    `{tensor: {file, dtype, shape, sha256}}`, the per-tensor hash being the sha256 of that tensor's bytes in
    the file. `threads`: see `ckpt.shard_io.io_threads`.
    """
    # "format": "pt" is the metadata transformers and safetensors' own loaders expect from PyTorch files.
    lay = layout(tensors, metadata={"format": "pt"})
    file_sha, tensor_sha = write_layout(path, lay, threads, fsync=fsync)
    records = {
        p.name: {"file": path.name, "dtype": TORCH_NAME[st_dtype(p.tensor.dtype)], "shape": list(p.tensor.shape),
                 "sha256": tensor_sha[p.name]}
        for p in lay.placed
    }  # fmt: skip
    return {"sha256": file_sha, "size": lay.size}, records
