"""`inspect_checkpoint`: what a checkpoint holds, as plain data (the CLI renders it as a table or JSON).

Reads only the manifest (a large checkpoint is summarised instantly); `verify=True` also hashes every file
and lists the problems (`ckpt.integrity`), which is what `moectl ckpt inspect --verify` shows.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

from ckpt.integrity import verify_checkpoint
from ckpt.layout import OPTIMIZER_SUFFIXES, detect_layout
from ckpt.reader import open_checkpoint
from moectl.core.errors import CheckpointError


@dataclass
class TensorRow:
    """One tensor: where it lives, what it is, and how big."""

    name: str
    file: str
    dtype: str
    shape: list[int]
    numel: int
    nbytes: int
    role: str  # model | main_param | exp_avg | exp_avg_sq | momentum_buffer


@dataclass
class CheckpointSummary:
    """A checkpoint at a glance; `to_json()` is what `--json` prints."""

    path: str
    step: int
    consumed_samples: int
    expert_layout: str
    expert_bias_layout: Optional[str]  # None when there are no expert biases
    glu_interleave_size: Optional[int]
    recipe: dict[str, Any]
    world: dict[str, Any]  # dp, ep, and owners summarised: {key: tensor count} for lists and dicts
    probe: dict[str, Any]
    writer: dict[str, str]
    files: list[dict[str, Any]]  # name, size, rank, tensors
    tensors: list[TensorRow]
    totals: dict[str, Any]
    problems: Optional[list[str]] = field(default=None)  # None: not verified; [] verified intact

    def to_json(self) -> dict[str, Any]:
        """Every field, and `"readable": true`: the JSON of a checkpoint that cannot be read says false."""
        d = asdict(self)
        return {"path": d.pop("path"), "readable": True, **d}


def tensor_role(name: str) -> str:
    """`model` for a model tensor, else the optimizer suffix without its dot."""
    for s in OPTIMIZER_SUFFIXES:
        if name.endswith(s):
            return s[1:]
    return "model"


def inspect_checkpoint(path: str | os.PathLike[str], verify: bool = False) -> CheckpointSummary:
    """Summarise the checkpoint at `path` (a step folder, or a checkpoints folder's `latest`)."""
    with open_checkpoint(path, verify=False) as ck:
        m = ck.manifest
        rows = []
        for name in ck.tensor_names():
            rec = m["tensors"][name]
            numel = 1
            for d in rec["shape"]:
                numel *= d
            size = getattr(torch, rec["dtype"]).itemsize
            row = TensorRow(name, rec["file"], rec["dtype"], list(rec["shape"]), numel, numel * size, tensor_role(name))
            rows.append(row)
        per_file = Counter(r.file for r in rows)
        files = [{"name": f, "size": rec["size"], "rank": rec["rank"], "tensors": per_file[f]}
                 for f, rec in m["files"].items()]  # fmt: skip
        world = m["world"]
        summary = CheckpointSummary(
            path=str(ck.path),
            step=ck.step,
            consumed_samples=m["consumed_samples"],
            expert_layout=m["expert_layout"],
            expert_bias_layout=_bias_layout(ck.tensor_names()),
            glu_interleave_size=m["glu_interleave_size"],
            recipe=m["recipe"],
            world={"dp": world["dp"], "ep": world["ep"], "owners": {
                k: len(v) if isinstance(v, (list, dict)) else v for k, v in world["owners"].items()}},
            probe=m["probe"],
            writer=m["writer"],
            files=files,
            tensors=rows,
            totals=_totals(rows, files),
        )
    if verify:
        summary.problems = [str(p) for p in verify_checkpoint(summary.path)]
    return summary


def _bias_layout(names: list[str]) -> Optional[str]:
    try:
        return detect_layout(names, "bias")
    except CheckpointError:  # inspect shows what is there; convert and load refuse it
        return "mixed"


def _totals(rows: list[TensorRow], files: list[dict[str, Any]]) -> dict[str, Any]:
    by_role: dict[str, dict[str, int]] = {}
    by_dtype: dict[str, int] = {}
    for r in rows:
        agg = by_role.setdefault(r.role, {"tensors": 0, "numel": 0, "bytes": 0})
        agg["tensors"] += 1
        agg["numel"] += r.numel
        agg["bytes"] += r.nbytes
        by_dtype[r.dtype] = by_dtype.get(r.dtype, 0) + r.nbytes
    return {
        "tensors": len(rows),
        "parameters": by_role.get("model", {}).get("numel", 0),
        "tensor_bytes": sum(r.nbytes for r in rows),
        "file_bytes": sum(f["size"] for f in files),
        "files": len(files),
        "by_role": by_role,
        "bytes_by_dtype": dict(sorted(by_dtype.items())),
    }


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (binary units, as the file sizes on disk)."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{int(x)} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")

