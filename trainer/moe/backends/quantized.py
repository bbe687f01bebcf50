"""The `loop` and `grouped` expert backends under a low-precision recipe (`trainer/moe/expert_precision.py`).

Same math as their high-precision paths, `y = probs * (fc2(act(fc1(x) + b1)) + b2)`, with fc1 and fc2 run
by the recipe (quantized operands, native or emulated GEMMs) and everything between them (biases, the
activation and its hand-written backward, the probs) in the activations' dtype, exactly as the
high-precision grouped backend does it:

    grouped   one grouped GEMM per linear over all experts: token groups = expert segments, per-expert
              weight scales (grouped_fprop / grouped_dgrad / grouped_wgrad)
    loop      the reference: expert by expert, each segment and weight quantized on its own, plain
              fprop / dgrad / wgrad

The two quantize the same values the same way and share everything between the GEMMs, so they agree
bitwise wherever the per-expert and grouped GEMMs do (the emulated ones on CPU, tests/trainer/moe).
Padding rows (prob 0) give zero output and zero grads, as without a recipe; with an fc1 bias they do
carry act(b1) into fc2's input, so for per-tensor scaling they take part in that group's amax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from trainer.moe.backends import WgradFn
from trainer.moe.expert_math import (
    ExpertSpec,
    activation,
    activation_backward,
    bias_grads,
    expert_of_row,
    scale_by_probs,
    unscale_grad,
)
from trainer.moe.expert_precision import ExpertPrecision, SavedLinear, qlinear_dgrad, qlinear_forward, qlinear_wgrad
from trainer.precision.groups import TokenGroups

Tensor = torch.Tensor
OptTensor = Optional[torch.Tensor]


@dataclass
class QuantizedCtx:
    """What backward needs: per expert segment (loop) or once (grouped) the saved fc1 and fc2 operands."""

    grouped: bool
    fc1: list[SavedLinear]  # one (grouped) or one per expert (loop); empty without need_grad
    fc2: list[SavedLinear]
    h_TH: Tensor  # fc1 output + b1 (the activation is recomputed from it)
    counts: list[int]  # rows per expert (loop only)
    tokens_per_expert_E: Tensor
    b1_EH: OptTensor
    b2_ED: OptTensor
    probs_T: OptTensor
    z_TD: OptTensor  # fc2 output + b2, for dprobs
    spec: ExpertSpec


def _saved(s: Optional[SavedLinear]) -> SavedLinear:
    if s is None:
        raise RuntimeError("expert backward without a forward that kept its operands (need_grad was off)")
    return s


def forward(
    grouped: bool, x_TD: Tensor, w1_EHD: Tensor, b1_EH: OptTensor, w2_EDF: Tensor, b2_ED: OptTensor,
    tokens_per_expert_E: Tensor, probs_T: OptTensor, spec: ExpertSpec, p: ExpertPrecision,
) -> tuple[Tensor, QuantizedCtx]:  # fmt: skip
    """The expert MLP in the recipe, as one grouped GEMM per linear (`grouped`) or expert by expert."""
    p.check_aligned(tokens_per_expert_E)
    x_TD = x_TD.contiguous()
    T = x_TD.shape[0]
    fc1: list[SavedLinear] = []
    fc2: list[SavedLinear] = []
    if grouped:
        offs_E = torch.cumsum(tokens_per_expert_E, dim=0)
        groups = TokenGroups.from_offsets(offs_E, T, validate=x_TD.device.type == "cpu", uniform=p.uniform_rows)
        h_TH, s1 = qlinear_forward(p, "fc1", x_TD, w1_EHD, groups)
        counts: list[int] = []
    else:
        counts = [int(c) for c in tokens_per_expert_E.tolist()]
        starts = [sum(counts[:e]) for e in range(len(counts))]
        parts = [qlinear_forward(p, "fc1", x_TD[s : s + n], w1_EHD[e], None, expert=e)
                 for e, (s, n) in enumerate(zip(starts, counts))]  # fmt: skip
        h_TH = torch.cat([h for h, _ in parts])
    rows_T = expert_of_row(tokens_per_expert_E, T) if b1_EH is not None or b2_ED is not None else None
    if b1_EH is not None:
        h_TH = h_TH + b1_EH[rows_T]
    a_TF = activation(h_TH, spec)
    if grouped:
        z_TD, s2 = qlinear_forward(p, "fc2", a_TF, w2_EDF, groups)
        if p.need_grad:
            fc1, fc2 = [_saved(s1)], [_saved(s2)]
    else:
        parts2 = [qlinear_forward(p, "fc2", a_TF[s : s + n], w2_EDF[e], None, expert=e)
                  for e, (s, n) in enumerate(zip(starts, counts))]  # fmt: skip
        z_TD = torch.cat([z for z, _ in parts2])
        if p.need_grad:
            fc1, fc2 = [_saved(s) for _, s in parts], [_saved(s) for _, s in parts2]
    if b2_ED is not None:
        z_TD = z_TD + b2_ED[rows_T]
    y_TD = scale_by_probs(z_TD, probs_T)
    ctx = QuantizedCtx(
        grouped, fc1, fc2, h_TH, counts, tokens_per_expert_E, b1_EH, b2_ED, probs_T,
        None if probs_T is None else z_TD, spec,
    )  # fmt: skip
    return y_TD, ctx


def backward(ctx: QuantizedCtx, dy_TD: Tensor) -> tuple[OptTensor, ...]:
    """(dx, dw1, db1, dw2, db2, dprobs); weight grads fp32 (bf16 from a native grouped wgrad), the rest in
    their inputs' dtypes."""
    dx_TD, dprobs_T, wgrad = backward_dgrad(ctx, dy_TD)
    dw1_EHD, db1_EH, dw2_EDF, db2_ED = wgrad()
    return dx_TD, dw1_EHD, db1_EH, dw2_EDF, db2_ED, dprobs_T


def backward_dgrad(ctx: QuantizedCtx, dy_TD: Tensor) -> tuple[Tensor, OptTensor, WgradFn]:
    """(dx, dprobs, wgrad): fc2's and fc1's output grads are quantized and their data grads computed now;
    `wgrad()` runs the weight-grad GEMMs on those quantized grads (and the bias grads) later."""
    if not ctx.fc1:
        raise RuntimeError("expert backward after a forward without grad (need_grad was off)")
    dz_TD, dprobs_T = unscale_grad(dy_TD.contiguous(), ctx.z_TD, ctx.probs_T)
    if ctx.grouped:
        da_TF, g2 = qlinear_dgrad(ctx.fc2[0], dz_TD)
        g2s = [g2]
    else:
        da_TF, g2s = _per_expert_dgrad(ctx.fc2, dz_TD, ctx.counts)
    dh_TH = activation_backward(ctx.h_TH, da_TF, ctx.spec)
    if ctx.grouped:
        dx_TD, g1 = qlinear_dgrad(ctx.fc1[0], dh_TH)
        g1s = [g1]
    else:
        dx_TD, g1s = _per_expert_dgrad(ctx.fc1, dh_TH, ctx.counts)

    def wgrad() -> tuple[Tensor, OptTensor, Tensor, OptTensor]:
        dw2_EDF = _wgrads(ctx.fc2, g2s, ctx.grouped)
        dw1_EHD = _wgrads(ctx.fc1, g1s, ctx.grouped)
        db1_EH, db2_ED = bias_grads(dh_TH, dz_TD, ctx.tokens_per_expert_E, ctx.b1_EH, ctx.b2_ED)
        return dw1_EHD, db1_EH, dw2_EDF, db2_ED

    return dx_TD, dprobs_T, wgrad


def _per_expert_dgrad(saved: list[SavedLinear], dy_TO: Tensor, counts: list[int]) -> tuple[Tensor, list]:
    """The loop's data grads of one linear, expert by expert, with each expert's quantized output grad."""
    dxs, gqs, start = [], [], 0
    for s, n in zip(saved, counts):
        dx, gq = qlinear_dgrad(s, dy_TO[start : start + n])
        dxs.append(dx)
        gqs.append(gq)
        start += n
    return torch.cat(dxs), gqs


def _wgrads(saved: list[SavedLinear], gqs: list, grouped: bool) -> Tensor:
    """The weight grad of one linear: one grouped GEMM, or expert by expert stacked."""
    if grouped:
        return qlinear_wgrad(saved[0], gqs[0])
    return torch.stack([qlinear_wgrad(s, gq) for s, gq in zip(saved, gqs)])
