"""`convert_checkpoint`: rewrite a checkpoint in the other expert layout (and back, bit-exact).

Weights, fp32 masters and optimizer moments go through the one normalisation the loader uses
(`ckpt.layout.normalize_for_model`); everything else is copied byte for byte. The result is an ordinary
committed checkpoint written by `save_checkpoint` (sha256s, manifest last), with the same step, the same
file names and the manifest meta carried over except what the conversion changes: `expert_layout`,
`glu_interleave_size`, and the matching `config.moe` keys (`single_grouped_weight`, `single_grouped_bias`,
`glu_interleave_size`), so that the checkpoint's own config builds a model its tensors fit.

Memory: one output file at a time. Stacking pulls an expert set into the file holding its expert 0
(with expert parallelism the members may sit in several ranks' files); unbinding keeps the grouped
tensor's file. Biases follow the weights: a checkpoint with grouped weights and per-expert biases
(`single_grouped_weight` without `single_grouped_bias`) comes out uniform.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ckpt.layout import (
    LAYOUTS,
    SINGLE_GROUPED,
    detect_layout,
    fc1_row_order,
    group_expert_keys,
    normalize_for_model,
    parse_expert_key,
)
from ckpt.cleanup import undo_new_root
from ckpt.collective import SOLO
from ckpt.destination import new_destination, raise_write_failure
from ckpt.integrity import BackgroundVerify
from ckpt.reader import Checkpoint, open_checkpoint, refusal
from ckpt.save import save_checkpoint
from moectl.core.errors import CheckpointError


class _Keep:
    def __repr__(self) -> str:
        return "KEEP"


KEEP = _Keep()  # `glu_interleave_size=KEEP`: leave fc1's row order as it is


class FilesOnDemand(dict):
    """`{file name: tensors}` whose tensors are built when `save_checkpoint` asks for that file.

    `save_checkpoint` writes file by file, so only one output file is in memory at a time; it is a dict
    because `save_checkpoint` checks for one (reading a file twice would just build it twice).
    """

    def __init__(self, plan: dict[str, list[str]], build: Callable[[list[str]], dict[str, torch.Tensor]]) -> None:
        super().__init__({f: None for f in plan})
        self._plan, self._build = plan, build

    def __getitem__(self, fname: str) -> dict[str, torch.Tensor]:
        return self._build(self._plan[fname])

    def get(self, fname: str, default: Any = None) -> Any:
        return self[fname] if fname in self._plan else default

    def items(self) -> Any:  # type: ignore[override]
        return ((f, self[f]) for f in self._plan)

    def values(self) -> Any:  # type: ignore[override]
        return (self[f] for f in self._plan)


def checkpoint_num_experts(ck: Checkpoint) -> int:
    """E: the config's `moe.num_experts` when recorded, else read off the expert tensors (which must agree)."""
    moe = ck.meta.get("config", {}).get("moe")
    if isinstance(moe, dict) and isinstance(moe.get("num_experts"), int):
        return moe["num_experts"]
    found: dict[int, str] = {}  # candidate E -> a tensor that implies it
    for name in ck.tensor_names():
        k = parse_expert_key(name)
        if k is not None:
            found.setdefault(ck.tensor_info(name).shape[0] if k.index is None else -1, name)
    top = max((k.index for k in map(parse_expert_key, ck.tensor_names()) if k and k.index is not None), default=None)
    if -1 in found:
        found.setdefault(top + 1, found.pop(-1))  # type: ignore[operator]
    if len(found) > 1:
        raise CheckpointError(
            f"{ck.path}: expert counts disagree ({', '.join(f'{n} from {t!r}' for n, t in found.items())}) "
            "and the config records no moe.num_experts",
            "record moe.num_experts in the checkpoint's config",
        )
    return next(iter(found), 1)


def plan_files(ck: Checkpoint, layout: str, num_experts: int) -> dict[str, list[str]]:
    """Which source tensors each output file is built from (same file names as the source)."""
    names = ck.tensor_names()
    groups = group_expert_keys(names, num_experts)
    plan: dict[str, list[str]] = {f: [] for f in sorted(ck.manifest["files"])}
    for name in names:
        fname = ck.tensor_info(name).file
        k = parse_expert_key(name)
        if k is None or k.index is None or layout != SINGLE_GROUPED:
            plan[fname].append(name)
        elif k.index == 0:  # the stack lands where expert 0 was
            plan[fname] += groups[k.grouped_name].names()
    return plan


def converted_meta(meta: dict[str, Any], layout: str, interleave: Optional[int]) -> dict[str, Any]:
    """The source meta with the layout, the interleave and the matching `config.moe` keys updated."""
    out = copy.deepcopy(meta)
    out["expert_layout"] = layout
    out["glu_interleave_size"] = interleave
    moe = out.get("config", {}).get("moe")
    if isinstance(moe, dict):
        grouped = layout == SINGLE_GROUPED
        moe["single_grouped_weight"] = grouped
        moe["single_grouped_bias"] = grouped and bool(moe.get("add_bias", False))
        moe["glu_interleave_size"] = interleave
    return out


def convert_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    layout: str,
    *,
    glu_interleave_size: Optional[int] | _Keep = KEEP,
) -> Path:
    """Convert the checkpoint at `src` (a step folder, or a checkpoints folder's `latest`) to `layout`.

    `dst` is a new checkpoints folder (it must not exist); the result is `dst/step_N` (N = the source's
    step) with `dst/latest` naming it. `glu_interleave_size` (int or None) also reorders fc1's rows;
    KEEP leaves them. Returns the new step folder. The source is never modified, and verified while it is
    converted (its files are hashed on another thread, so they are read from disk about once): the result
    commits only if every source file hashed as recorded; otherwise nothing is committed and the error
    names the source's first problem.
    """
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown expert layout {layout!r}", f"use one of: {', '.join(LAYOUTS)}")
    with open_checkpoint(src, verify=False) as ck:  # the manifest and its seal; the files are hashed alongside
        verifying = BackgroundVerify(ck.path)
        try:
            return _convert(ck, Path(dst), layout, glu_interleave_size, verifying)
        except Exception:
            problems = verifying.problems()  # a damaged source explains a failure better than its symptom does
            if problems:
                raise refusal(ck.path, problems) from None
            raise


def _convert(ck: Checkpoint, dst: Path, layout: str, glu_interleave_size: Optional[int] | _Keep,
             verifying: BackgroundVerify) -> Path:
    root = _new_root(dst, ck.path)
    meta = ck.meta
    num_experts = checkpoint_num_experts(ck)
    have = detect_layout(ck.tensor_names())
    if have is not None and have != meta["expert_layout"]:
        raise CheckpointError(
            f"{ck.path}: the manifest says expert_layout {meta['expert_layout']!r} but the weights are {have}",
            "the checkpoint is inconsistent; re-save it from the training run",
        )
    src_i = meta["glu_interleave_size"]
    dst_i = src_i if glu_interleave_size is KEEP else glu_interleave_size
    moe_cfg = meta.get("config", {}).get("moe", {})
    ffn = moe_cfg.get("ffn_hidden_size")
    if dst_i != src_i:  # refuse now what would otherwise fail halfway through the save
        if moe_cfg.get("activation") == "squared_relu":
            raise CheckpointError("glu_interleave_size applies to gated activations; this model's experts "
                                  "use squared_relu", "convert without --glu-interleave-size")  # fmt: skip
        if isinstance(ffn, int):
            fc1_row_order(src_i, dst_i, ffn)

    def build(names: list[str]) -> dict[str, torch.Tensor]:
        tensors = {n: ck.read(n) for n in names}
        return normalize_for_model(tensors, num_experts=num_experts, target_layout=layout,  # type: ignore[arg-type]
                                   source_interleave=src_i, target_interleave=dst_i, ffn_size=ffn)  # fmt: skip

    def source_intact() -> None:  # before the vote: nothing commits unless the source hashed as recorded
        problems = verifying.problems()
        if problems:
            raise refusal(ck.path, problems)

    files = FilesOnDemand(plan_files(ck, layout, num_experts), build)
    try:
        return save_checkpoint(root, ck.step, files, converted_meta(meta, layout, dst_i), group=SOLO,
                               precondition=source_intact)
    except BaseException as e:
        undo_new_root(root)
        raise_write_failure("the converted checkpoint", root, e)  # the OS refused a write: one line
        raise


def _new_root(dst: Path, src_step_dir: Path) -> Path:
    return new_destination(dst, "give a new folder: convert never overwrites", source=src_step_dir)


