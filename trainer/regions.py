"""Named profiler regions of a training step, so a profile can say where device time goes.

`region(name)` opens a `torch.profiler.record_function` range only while a profiler is recording. Without
one it returns a shared null context: an unconditional `record_function` costs a dispatcher call on entry
and exit (about 10 us per region measured on the 2-core CI box), a gated one a C-level flag check
(about 0.3 us), so the regions stay in the model for every run at no measurable cost.

A range encloses the CPU ops a region launches in the forward. Backward work is attributed to the forward
region through the autograd sequence number that the profiler records on both sides (see
`moectl/bench/device_time.py`), so no range is needed there.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch.autograd.profiler import record_function

EMBEDDING = "embedding"
NORM = "norm"  # a decoder layer's input and pre-MLP RMSNorm, with the residual add before each (but the first)
ATTENTION = "attention"  # qkv projection, RoPE, scaled dot-product attention, output projection
ROUTER = "moe.router"
DISPATCH = "moe.dispatch"  # permute (sort by expert, gather, pad/drop) and, with ep > 1, the token exchange
EXPERTS = "moe.experts"
COMBINE = "moe.combine"  # unpermute back to tokens and the sum of a token's top-k outputs
DENSE_MLP = "mlp.dense"
HEAD = "model.head"  # final norm and output projection
LOSS = "model.loss"  # cross-entropy (logits cast to fp32) and the routers' aux losses
GRAD_ACCUMULATE = "grad.accumulate"  # a fused weight grad added into main_grad
OPTIMIZER = "optimizer.step"  # grad sync, clipping, the update, param gather

ALL = (EMBEDDING, NORM, ATTENTION, ROUTER, DISPATCH, EXPERTS, COMBINE, DENSE_MLP, HEAD, LOSS, GRAD_ACCUMULATE,
       OPTIMIZER)  # fmt: skip

_NULL: ContextManager[None] = contextlib.nullcontext()
_profiler_enabled = torch._C._autograd._profiler_enabled


def region(name: str) -> ContextManager[object]:
    """A profiler range named `name` while a profiler records, else a no-op (cheap: see the module doc)."""
    # Inside torch.compile'd code the range would be traced as a no-op anyway; skip the C call there.
    if torch.compiler.is_compiling() or not _profiler_enabled():
        return _NULL
    return record_function(name)
