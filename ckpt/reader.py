"""`open_checkpoint` and `Checkpoint`: read tensors (or just a rank's slice of them) from a checkpoint.

Reading goes through `safetensors.safe_open(..., framework="pt")`, which memory-maps the file and parses
only its JSON header; `get_slice` copies out just the requested rows, so a rank that owns a slice of a
tensor never materialises the rest. Nothing here can execute code: only JSON and safetensors are read.
By default the whole checkpoint is verified first (`ckpt.integrity`) and any problem refuses the load.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ckpt import manifest
from ckpt.discovery import TOOL_ADVICE, denied, resolve_load_path
from ckpt.integrity import verify_checkpoint
from ckpt.manifest import META_OPTIONAL, META_REQUIRED
from ckpt.problems import MANIFEST, Problem
from ckpt.seal import seal_problem, unsealed_note
from ckpt.st_header import TORCH_NAME
from moectl.core.errors import CheckpointError

Slices = slice | int | tuple[Any, ...] | None
_ST_DTYPE = {v: k for k, v in TORCH_NAME.items()}  # manifest (torch) dtype name -> safetensors dtype


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, per the manifest."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class Checkpoint:
    """One committed checkpoint, opened for reading. Use as a context manager (or call `close`)."""

    def __init__(self, path: Path, manifest_dict: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest_dict
        self._handles: dict[str, Any] = {}

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def meta(self) -> dict[str, Any]:
        """The caller's part of the manifest, as given to `save_checkpoint`."""
        return {k: self.manifest[k] for k in META_REQUIRED + META_OPTIONAL if k in self.manifest}

    def tensor_names(self) -> list[str]:
        """Every tensor in the checkpoint, sorted."""
        return sorted(self.manifest["tensors"])

    def tensor_info(self, name: str) -> TensorInfo:
        """The manifest's record of `name` (CheckpointError if there is no such tensor)."""
        rec = self._record(name)
        return TensorInfo(rec["file"], getattr(torch, rec["dtype"]), tuple(rec["shape"]))

    def read(self, name: str, slices: Slices = None) -> torch.Tensor:
        """Tensor `name`, or only `tensor[slices]` (a slice, an int, or a tuple of them, as in indexing).

        The file's dtype and shape are checked against the manifest before anything is copied.
        """
        rec = self._record(name)
        fname = rec["file"]
        try:
            handle = self._handle(fname)
            view = handle.get_slice(name)
            dtype, shape = view.get_dtype(), list(view.get_shape())
        except Exception as e:
            raise CheckpointError(
                f"{self.path / fname} tensor {name!r}: cannot read it ({e})",
                f"run `moectl ckpt validate {self.path}` to see what is wrong with the file",
            ) from None
        want_dtype = _ST_DTYPE[rec["dtype"]]
        if dtype != want_dtype or shape != rec["shape"]:
            raise CheckpointError(
                f"{self.path / fname} tensor {name!r} is {dtype}{shape}, the manifest says {want_dtype}{rec['shape']}",
                f"the file changed after it was saved; run `moectl ckpt validate {self.path}`",
            )
        try:
            if slices is None:
                return handle.get_tensor(name)
            return view[slices]
        except Exception as e:
            raise CheckpointError(
                f"{self.path / fname} tensor {name!r} {rec['dtype']}{rec['shape']}: cannot take slice {slices!r} ({e})",
                "give one slice or int per dimension, within the tensor's shape",
            ) from None

    def _record(self, name: str) -> dict[str, Any]:
        rec = self.manifest["tensors"].get(name)
        if rec is None:
            raise CheckpointError(
                f"{self.path} has no tensor {name!r}",
                "use Checkpoint.tensor_names() (or `moectl ckpt inspect`) to see what it holds",
            )
        return rec

    def _handle(self, fname: str) -> Any:
        if fname not in self._handles:
            self._handles[fname] = safe_open(str(self.path / fname), framework="pt", device="cpu")
        return self._handles[fname]

    def close(self) -> None:
        """Release the memory maps."""
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, step={self.step}, tensors={len(self.manifest['tensors'])})"


def refusal(step_dir: Path, problems: list[Problem]) -> CheckpointError:
    """The error that refuses to load `step_dir` for `problems` (the first named, the rest counted); where one is
    a file this user may not read, the error that says so (`ckpt.discovery.denied`: exit 2, a chmod)."""
    refused = denied(step_dir, problems)
    if refused is not None:
        return refused
    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    return CheckpointError(
        f"refusing to load {step_dir}: {problems[0]}{more}",
        f"run `moectl ckpt validate {step_dir}` for the full list, and load another step",
    )


def open_checkpoint(path: str | os.PathLike[str], verify: bool = True) -> Checkpoint:
    """Open the checkpoint at `path`: a step folder, or a checkpoints folder (then the step `latest` names).

    With `verify` (the default) every file is hashed and checked first; any problem raises
    CheckpointError naming the first one and counting the rest. Without it only the manifest is checked
    (its schema and its digest: an edited run state never loads), and each `read` still checks its tensor's
    dtype and shape (for tools that read a few tensors of a large checkpoint whose integrity they verify
    otherwise). A format 1 manifest, which has no digest, loads with a warning (ckpt/seal.py).
    """
    step_dir = resolve_load_path(path, TOOL_ADVICE)  # the trainer resolves checkpoint.load itself, with its own advice
    m, problems = manifest.load(step_dir)
    if verify:
        problems = verify_checkpoint(step_dir)
    elif m is not None and seal_problem(m):
        problems = [Problem(MANIFEST, "manifest.json", None, seal_problem(m) or "")]
    if problems or m is None:
        raise refusal(step_dir, problems)
    note = unsealed_note(m)
    if note:
        warnings.warn(f"{step_dir}: {note}", UserWarning, stacklevel=2)
    return Checkpoint(step_dir, m)
