"""A moectl expert backend as an autograd node, for the benchmarks (what `GroupedMLP` does, minus layouts)."""

from __future__ import annotations

from typing import Any

import torch


class BackendFunction(torch.autograd.Function):
    """A moectl expert backend (protocol: forward/backward over plain tensors) as an autograd node."""

    @staticmethod
    def forward(ctx: Any, x, w1, w2, probs, counts, backend, spec, make_precision=None):  # type: ignore[no-untyped-def, override]
        # make_precision: a recipe's fresh per-call ExpertPrecision (the fp8 columns), or None for bf16
        kw = {} if make_precision is None else {"precision": make_precision()}
        y, ctx.backend_ctx = backend.forward(x, w1, None, w2, None, counts, probs, spec, **kw)
        ctx.backend = backend
        return y

    @staticmethod
    def backward(ctx: Any, dy):  # type: ignore[no-untyped-def, override]
        dx, dw1, _, dw2, _, dprobs = ctx.backend.backward(ctx.backend_ctx, dy)
        ctx.backend_ctx = None
        return dx, dw1, dw2, dprobs, None, None, None, None
