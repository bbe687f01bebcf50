"""The `loop` expert backend: the reference, per-expert matmuls with an autograd backward (see `__init__.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from trainer.moe.backends import WgradFn, quantized
from trainer.moe.expert_math import ExpertSpec, activation, scale_by_probs

if TYPE_CHECKING:
    from trainer.moe.expert_precision import ExpertPrecision

Tensor = torch.Tensor
OptTensor = Optional[torch.Tensor]


@dataclass
class _LoopCtx:
    x_TD: torch.Tensor
    w1_EHD: torch.Tensor
    b1_EH: Optional[torch.Tensor]
    w2_EDF: torch.Tensor
    b2_ED: Optional[torch.Tensor]
    counts: list[int]
    probs_T: Optional[torch.Tensor]
    spec: ExpertSpec


class LoopBackend:
    """Per-expert matmuls. Backward recomputes each expert's graph and asks autograd, so it is obviously right.

    It syncs the host for the counts and launches ~10 small kernels per expert: a reference, not a fast path.
    """

    name = "loop"

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = device

    @staticmethod
    def _expert(
        x: Tensor, w1: Tensor, b1: OptTensor, w2: Tensor, b2: OptTensor, p: OptTensor, spec: ExpertSpec
    ) -> Tensor:
        h = x @ w1.t()
        if b1 is not None:
            h = h + b1
        z = activation(h, spec) @ w2.t()
        if b2 is not None:
            z = z + b2
        return scale_by_probs(z, p)

    def forward(
        self, x_TD: Tensor, w1_EHD: Tensor, b1_EH: OptTensor, w2_EDF: Tensor, b2_ED: OptTensor,
        tokens_per_expert_E: Tensor, probs_T: OptTensor, spec: ExpertSpec,
        precision: Optional["ExpertPrecision"] = None,
    ) -> tuple[Tensor, Any]:  # fmt: skip
        """See the module docstring; with `precision`, expert by expert in the recipe (quantized.py)."""
        if precision is not None:
            return quantized.forward(
                False, x_TD, w1_EHD, b1_EH, w2_EDF, b2_ED, tokens_per_expert_E, probs_T, spec, precision
            )
        counts = [int(c) for c in tokens_per_expert_E.tolist()]
        y_TD = x_TD.new_zeros(x_TD.shape[0], w2_EDF.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n:
                sl = slice(start, start + n)
                y_TD[sl] = self._expert(
                    x_TD[sl], w1_EHD[e], None if b1_EH is None else b1_EH[e], w2_EDF[e],
                    None if b2_ED is None else b2_ED[e], None if probs_T is None else probs_T[sl], spec,
                )  # fmt: skip
            start += n
        return y_TD, _LoopCtx(x_TD, w1_EHD, b1_EH, w2_EDF, b2_ED, counts, probs_T, spec)

    def backward(self, ctx: Any, dy_TD: Tensor) -> tuple[OptTensor, ...]:
        """See the module docstring: the data grads, then the weight grads."""
        dx_TD, dprobs_T, wgrad = self.backward_dgrad(ctx, dy_TD)
        dw1_EHD, db1_EH, dw2_EDF, db2_ED = wgrad()
        return dx_TD, dw1_EHD, db1_EH, dw2_EDF, db2_ED, dprobs_T

    def backward_dgrad(self, ctx: Any, dy_TD: Tensor) -> tuple[Tensor, OptTensor, WgradFn]:
        """(dx, dprobs, wgrad). Each expert's graph is recomputed and autograd asked for the input grads now
        (the graph kept), and for the weight and bias grads when `wgrad()` runs."""
        if not isinstance(ctx, _LoopCtx):
            return quantized.backward_dgrad(ctx, dy_TD)
        grads = [
            torch.zeros_like(t) if t is not None else None
            for t in (ctx.x_TD, ctx.w1_EHD, ctx.b1_EH, ctx.w2_EDF, ctx.b2_ED, ctx.probs_T)
        ]
        kept: list[tuple[int, slice, Tensor, list[OptTensor]]] = []  # (expert, rows, y, leaves)
        start = 0
        for e, n in enumerate(ctx.counts):
            if not n:
                continue
            sl = slice(start, start + n)
            start += n
            leaves = [
                ctx.x_TD[sl], ctx.w1_EHD[e], None if ctx.b1_EH is None else ctx.b1_EH[e], ctx.w2_EDF[e],
                None if ctx.b2_ED is None else ctx.b2_ED[e], None if ctx.probs_T is None else ctx.probs_T[sl],
            ]  # fmt: skip
            leaves = [None if t is None else t.detach().requires_grad_(True) for t in leaves]
            with torch.enable_grad():
                y = self._expert(*leaves, ctx.spec)
            _take_grads(grads, leaves, (0, 5), y, dy_TD[sl], e, sl, retain=True)
            kept.append((e, sl, y, leaves))

        def wgrad() -> tuple[Tensor, OptTensor, Tensor, OptTensor]:
            for e, sl, y, leaves in kept:
                _take_grads(grads, leaves, (1, 2, 3, 4), y, dy_TD[sl], e, sl, retain=False)
            return grads[1], grads[2], grads[3], grads[4]  # type: ignore[return-value]

        return grads[0], grads[5], wgrad  # type: ignore[return-value]


def _take_grads(grads: list[OptTensor], leaves: list[OptTensor], which: tuple[int, ...], y: Tensor, dy: Tensor,
                e: int, sl: slice, retain: bool) -> None:  # fmt: skip
    """Ask autograd for the grads of `leaves[i]`, i in `which`, and copy them into expert e's (or rows
    `sl`'s) slot of `grads` (inputs 0 and 5 are per row, the rest per expert)."""
    idx = [i for i in which if leaves[i] is not None]
    if not idx:
        return
    got = torch.autograd.grad(y, [leaves[i] for i in idx], dy, allow_unused=True, retain_graph=retain)
    for i, g in zip(idx, got):
        if g is None:  # e.g. a squared_relu expert whose pre-activations are all negative
            continue
        dst = grads[i][sl] if i in (0, 5) else grads[i][e]  # type: ignore[index]
        dst.copy_(g)
