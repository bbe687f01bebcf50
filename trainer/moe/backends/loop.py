"""The `loop` expert backend: the reference, per-expert matmuls with an autograd backward (see `__init__.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from trainer.moe.backends import quantized
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
        """See the module docstring."""
        if not isinstance(ctx, _LoopCtx):
            return quantized.backward(ctx, dy_TD)
        grads = [
            torch.zeros_like(t) if t is not None else None
            for t in (ctx.x_TD, ctx.w1_EHD, ctx.b1_EH, ctx.w2_EDF, ctx.b2_ED, ctx.probs_T)
        ]
        start = 0
        for e, n in enumerate(ctx.counts):
            if not n:
                start += n
                continue
            sl = slice(start, start + n)
            leaves = [
                ctx.x_TD[sl], ctx.w1_EHD[e], None if ctx.b1_EH is None else ctx.b1_EH[e], ctx.w2_EDF[e],
                None if ctx.b2_ED is None else ctx.b2_ED[e], None if ctx.probs_T is None else ctx.probs_T[sl],
            ]  # fmt: skip
            leaves = [None if t is None else t.detach().requires_grad_(True) for t in leaves]
            with torch.enable_grad():
                y = self._expert(*leaves, ctx.spec)
                live = [t for t in leaves if t is not None]
                got = iter(torch.autograd.grad(y, live, dy_TD[sl], allow_unused=True))
            for i, t in enumerate(leaves):
                if t is None:
                    continue
                g = next(got)
                if g is None:  # e.g. a squared_relu expert whose pre-activations are all negative
                    continue
                dst = grads[i][sl] if i in (0, 5) else grads[i][e]  # type: ignore[index]
                dst.copy_(g)
            start += n
        return tuple(grads)
