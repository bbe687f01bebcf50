"""The `grouped` expert backend: two `torch._grouped_mm` GEMMs around an eager activation (see `__init__.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from moectl.core.errors import MoectlError
from trainer.moe.backends import WgradFn, quantized
from trainer.moe.expert_math import (
    ExpertSpec,
    activation,
    activation_backward,
    bias_grads,
    expert_of_row,
    scale_by_probs,
    unscale_grad,
)

if TYPE_CHECKING:
    from trainer.moe.expert_precision import ExpertPrecision

Tensor = torch.Tensor
OptTensor = Optional[torch.Tensor]


@dataclass
class _GroupedCtx:
    x_TD: torch.Tensor
    h_TH: torch.Tensor  # fc1 output (+ b1), kept; the activation is recomputed from it
    w1_EHD: torch.Tensor
    b1_EH: Optional[torch.Tensor]
    w2_EDF: torch.Tensor
    b2_ED: Optional[torch.Tensor]
    tokens_per_expert_E: torch.Tensor
    offs_E: torch.Tensor
    probs_T: Optional[torch.Tensor]
    z_TD: Optional[torch.Tensor]  # fc2 output (+ b2), kept for dprobs when there are probs
    spec: ExpertSpec


class GroupedBackend:
    """Two `torch._grouped_mm` GEMMs (fc1, fc2) with an eager activation between; hand-written backward.

    `_grouped_mm` wants int32 cumulative offsets and 16-byte-aligned strides (D and F multiples of 4 in
    fp32, 8 in bf16); rows past the last offset are left unwritten, so `tokens_per_expert_E` must sum to T.
    """

    name = "grouped"

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = device

    @staticmethod
    def _check(x_TD: torch.Tensor, w2_EDF: torch.Tensor) -> None:
        elems = 16 // x_TD.element_size()
        D, Fd = w2_EDF.shape[1], w2_EDF.shape[2]
        if D % elems or Fd % elems:
            raise MoectlError(
                f"the grouped expert backend needs hidden size ({D}) and expert ffn size ({Fd}) to be multiples "
                f"of {elems} for {x_TD.dtype} (torch._grouped_mm wants 16-byte-aligned strides)",
                "pick sizes that are multiples of 8, or set moe.backend: loop",
            )

    def forward(
        self, x_TD: Tensor, w1_EHD: Tensor, b1_EH: OptTensor, w2_EDF: Tensor, b2_ED: OptTensor,
        tokens_per_expert_E: Tensor, probs_T: OptTensor, spec: ExpertSpec,
        precision: Optional["ExpertPrecision"] = None,
    ) -> tuple[Tensor, Any]:  # fmt: skip
        """See the module docstring; with `precision`, the recipe's grouped GEMMs (quantized.py)."""
        if precision is not None:
            return quantized.forward(
                True, x_TD, w1_EHD, b1_EH, w2_EDF, b2_ED, tokens_per_expert_E, probs_T, spec, precision
            )
        self._check(x_TD, w2_EDF)
        x_TD = x_TD.contiguous()
        offs_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
        rows_E = None
        h_TH = torch._grouped_mm(x_TD, w1_EHD.transpose(-2, -1), offs=offs_E)
        if b1_EH is not None or b2_ED is not None:
            rows_E = expert_of_row(tokens_per_expert_E, x_TD.shape[0])
        if b1_EH is not None:
            h_TH = h_TH + b1_EH[rows_E]
        a_TF = activation(h_TH, spec)
        z_TD = torch._grouped_mm(a_TF, w2_EDF.transpose(-2, -1), offs=offs_E)
        if b2_ED is not None:
            z_TD = z_TD + b2_ED[rows_E]
        y_TD = scale_by_probs(z_TD, probs_T)
        ctx = _GroupedCtx(
            x_TD, h_TH, w1_EHD, b1_EH, w2_EDF, b2_ED, tokens_per_expert_E, offs_E, probs_T,
            None if probs_T is None else z_TD, spec,
        )  # fmt: skip
        return y_TD, ctx

    def backward(self, ctx: Any, dy_TD: Tensor) -> tuple[OptTensor, ...]:
        """See the module docstring: the data grads, then the weight grads."""
        dx_TD, dprobs_T, wgrad = self.backward_dgrad(ctx, dy_TD)
        dw1_EHD, db1_EH, dw2_EDF, db2_ED = wgrad()
        return dx_TD, dw1_EHD, db1_EH, dw2_EDF, db2_ED, dprobs_T

    def backward_dgrad(self, ctx: Any, dy_TD: Tensor) -> tuple[Tensor, OptTensor, WgradFn]:
        """(dx, dprobs, wgrad): the data grads now, the weight and bias grads when `wgrad()` is called."""
        if not isinstance(ctx, _GroupedCtx):
            return quantized.backward_dgrad(ctx, dy_TD)
        # _grouped_mm rejects stride-0 (expanded) operands, which is what autograd hands us for y.sum().
        dy_TD = dy_TD.contiguous()
        spec, offs_E = ctx.spec, ctx.offs_E
        dz_TD, dprobs_T = unscale_grad(dy_TD, ctx.z_TD, ctx.probs_T)
        a_TF = activation(ctx.h_TH, spec)  # recomputed: cheaper to redo than to keep [T, F] alive
        da_TF = torch._grouped_mm(dz_TD, ctx.w2_EDF, offs=offs_E)
        dh_TH = activation_backward(ctx.h_TH, da_TF, spec)
        dx_TD = torch._grouped_mm(dh_TH, ctx.w1_EHD, offs=offs_E)

        def wgrad() -> tuple[Tensor, OptTensor, Tensor, OptTensor]:
            # wgrad contracts over the rows of each expert: the 2D x 2D form of _grouped_mm, groups along K
            dw2_EDF = torch._grouped_mm(dz_TD.t(), a_TF, offs=offs_E)
            dw1_EHD = torch._grouped_mm(dh_TH.t(), ctx.x_TD, offs=offs_E)
            db1_EH, db2_ED = bias_grads(dh_TH, dz_TD, ctx.tokens_per_expert_E, ctx.b1_EH, ctx.b2_ED)
            return dw1_EHD, db1_EH, dw2_EDF, db2_ED

        return dx_TD, dprobs_T, wgrad
