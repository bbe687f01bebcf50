"""Published quantized weights at fixed addresses, refreshed outside the graph (seed 003's lesson).

A CUDA graph replays kernels on the addresses it captured, and no Python runs at replay. Low-precision
param gather publishes each step's weights as new `QuantizedTensor` objects: per-tensor FP8 with a fresh
decode-scale tensor and no columnwise copy (built at its first backward use and cached on the object, a
decision taken once per step: TransformerEngine issue 3051 baked exactly that "first micro-batch" decision
into a graph, and expert grads came out 200-3000x too small); staged recipes (MXFP8, NVFP4) with both copies
newly allocated. A graph captured over those would read the capture step's weights forever.

`StaticWeights.refresh()` runs eagerly before every step's replays (and before the capture): for each module
whose `quantized_weight` is set it copies the published values, rowwise and columnwise, into one pinned
`QuantizedTensor` per module, rebuilding the columnwise copy of a transposable scheme from the rowwise bytes
each time (exact: the same bytes transposed), and installs the pinned object as the module's weight. The
graph therefore never decides whether a cache is fresh: it reads tensors that are always current, and an
eager forward (eval, the probe) reads the same values.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import nn

from trainer.precision import QuantizedData, QuantizedTensor

COPIES = ("rowwise", "columnwise")


def _both_copies(qt: QuantizedTensor) -> QuantizedTensor:
    """`qt` with a columnwise copy that matches its rowwise bytes now (rebuilt when transposable)."""
    if qt.scheme.transposable and qt.rowwise is not None:
        return replace(qt, columnwise=None).with_columnwise()
    if qt.columnwise is None:
        raise ValueError(f"{qt.scheme.describe()}: a published weight without its columnwise copy cannot be replayed")
    return qt


def _clone(q: Optional[QuantizedData]) -> Optional[QuantizedData]:
    return None if q is None else q.map(torch.clone)


class StaticWeights:
    """The model's published quantized weights, pinned (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = [m for m in model.modules() if hasattr(m, "quantized_weight")]
        self.pinned: dict[nn.Module, QuantizedTensor] = {}

    @torch.no_grad()
    def refresh(self) -> int:
        """Copy every module's published weight into its pinned tensors and install them; returns how many
        weights were refreshed. Call after the param gather completed and before any replay."""
        done = 0
        for m in self.modules:
            qt: Optional[QuantizedTensor] = m.quantized_weight
            if qt is None:
                continue
            fresh = _both_copies(qt)
            pinned = self.pinned.get(m)
            if pinned is None:
                pinned = replace(fresh, rowwise=_clone(fresh.rowwise), columnwise=_clone(fresh.columnwise))
                self.pinned[m] = pinned
            else:
                _copy_into(pinned, fresh)
            m.quantized_weight = pinned
            done += 1
        return done


def _copy_into(dst: QuantizedTensor, src: QuantizedTensor) -> None:
    if tuple(dst.shape) != tuple(src.shape) or dst.scheme != src.scheme:
        raise ValueError(f"a published weight changed shape or scheme: {tuple(src.shape)} {src.scheme.describe()} "
                         f"for pinned {tuple(dst.shape)} {dst.scheme.describe()}")  # fmt: skip
    for which in COPIES:
        d, s = getattr(dst, which), getattr(src, which)
        if (d is None) != (s is None):
            raise ValueError(f"a published weight's {which} copy came and went between steps")
        if d is None:
            continue
        dt, st = d.tensors(), s.tensors()
        if dt.keys() != st.keys():
            raise ValueError(f"a published weight's {which} tensors changed: {sorted(st)} for {sorted(dt)}")
        for name, t in dt.items():
            if t.data_ptr() != st[name].data_ptr():
                t.copy_(st[name])
