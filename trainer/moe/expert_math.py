"""The expert MLP's math, once: what it computes (`ExpertSpec`), the gate/up views of fc1's output, the
activations and their derivatives, the routing-prob scaling and the per-expert row segments.

Every backend (loop, grouped, fused, quantized) computes with these; the fused backend's CPU path is
`fused_forward`/`fused_backward` below, which are also the oracle the Triton kernels
(`trainer/kernels/glu_triton.py`) are tested against. The names, the gated set and the fc1 row layout
themselves are torch-free facts in `moectl/core/facts.py`, which the checkpoint format reads too.

Legend: T rows given to the expert MLP (tokens after permute, grouped by expert), D model width,
H fc1 output width (2F gated, F otherwise), F expert ffn width, E experts, X any width.

    swiglu        silu(g) * u
    quick_geglu   g * sigmoid(1.702 g) * u
    squared_relu  relu(h) ** 2            (not gated: H == F)

The activation is computed in fp32 and returned in h's dtype, in every backend: bf16 inputs round once.

Why the fused path applies the routing probs to the activation: `fc2(p * a) == p * fc2(a)` row by row, so
scaling the F-wide activation costs nothing extra (it is written anyway), while scaling the D-wide expert
output would be one more pass over it. The fc2 bias does not commute that way: `p * (fc2(a) + b2)` needs
`p * b2` added after fc2 (`add_row_bias`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moectl.core.errors import MoectlError
from moectl.core.facts import ACTIVATIONS, QUICK_GELU_ALPHA, ffn_width, is_gated
from trainer.kernels import has_triton

Tensor = torch.Tensor
OptTensor = Optional[torch.Tensor]


@dataclass(frozen=True)
class ExpertSpec:
    """What the expert MLP computes, independent of layout and kernels."""

    activation: str  # one of ACTIVATIONS
    ffn_size: int  # F
    glu_interleave_size: Optional[int] = None  # I: fc1 rows stored as [g(I), u(I), g(I), ...]; None = [gate; up]

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise MoectlError(f"unknown expert activation {self.activation!r}", f"use one of {', '.join(ACTIVATIONS)}")
        I = self.glu_interleave_size
        if I is not None:
            if not self.gated:
                raise MoectlError(
                    f"glu_interleave_size={I} needs a gated activation, not {self.activation}",
                    "set moe.glu_interleave_size: null or use swiglu/quick_geglu",
                )
            if I <= 0 or self.ffn_size % I:
                raise MoectlError(
                    f"glu_interleave_size={I} must be positive and divide moe.ffn_hidden_size={self.ffn_size}",
                    "pick an interleave size that divides the expert ffn size",
                )

    @property
    def gated(self) -> bool:
        """Whether fc1 produces gate and up halves (H = 2F)."""
        return is_gated(self.activation)

    @property
    def fc1_out(self) -> int:
        """H: rows of the fc1 weight."""
        return 2 * self.ffn_size if self.gated else self.ffn_size


# --- fc1's gate and up halves ------------------------------------------------------------------------
def gate_up_views(h_TH: Tensor, interleave: Optional[int]) -> tuple[Tensor, Tensor]:
    """The gate and up halves of a gated fc1 output as views (no copy), in either row layout: `[T, F]`, or
    `[T, F/I, I]` blocks when interleaved (moectl/core/facts.py states the layout)."""
    t, h = h_TH.shape
    f = h // 2
    if interleave is None:
        return h_TH[:, :f], h_TH[:, f:]
    blocks_TBSI = h_TH.reshape(t, f // interleave, 2, interleave)  # S: 0 gate, 1 up
    return blocks_TBSI[:, :, 0, :], blocks_TBSI[:, :, 1, :]


# --- activations -------------------------------------------------------------------------------------
def act_and_partials(hb_TH: Tensor, activation: str, interleave: Optional[int]) -> tuple[Tensor, Tensor, OptTensor]:
    """act(h) and its partial derivatives w.r.t. gate and up (w.r.t. h when not gated; the second is then None),
    in h's dtype, shaped like the gate view (`[T, F]`, or `[T, F/I, I]` when interleaved). Differentiable."""
    if activation == "squared_relu":
        r = torch.relu(hb_TH)
        return r * r, 2.0 * r, None
    g, u = gate_up_views(hb_TH, interleave)
    alpha = 1.0 if activation == "swiglu" else QUICK_GELU_ALPHA
    s = torch.sigmoid(alpha * g)
    gs = g * s  # silu(g) for swiglu, quick_gelu(g) for quick_geglu
    dgs_dg = s + alpha * gs * (1.0 - s)
    return gs * u, u * dgs_dg, gs


def activation(h_TH: Tensor, spec: ExpertSpec) -> Tensor:
    """act(h) `[T, F]` in h's dtype (fp32 math), through differentiable ops (the loop backend autograds it)."""
    act, _, _ = act_and_partials(h_TH.float(), spec.activation, spec.glu_interleave_size)
    return act.reshape(h_TH.shape[0], spec.ffn_size).to(h_TH.dtype)


def activation_backward(h_TH: Tensor, da_TF: Tensor, spec: ExpertSpec) -> Tensor:
    """d act / d h times `da` `[T, H]` in h's dtype, by recomputation from h (fp32 math)."""
    dh_TH, _, _ = fused_backward(h_TH, None, da_TF, spec.activation, spec.glu_interleave_size)
    return dh_TH


# --- the fused activation: probs * act(h + b1[expert]) -------------------------------------------------
def _with_bias(h_TH: Tensor, b1_EH: OptTensor, expert_T: OptTensor) -> Tensor:
    """h + b1[expert_of_row] in fp32 (the kernels add the bias on load, so the stored h has none)."""
    h32_TH = h_TH.float()
    if b1_EH is None:
        return h32_TH
    if expert_T is None:
        raise ValueError("a bias needs expert_T, the expert index of every row")
    return h32_TH + b1_EH.float().index_select(0, expert_T.long())


def fused_forward(h_TH: Tensor, probs_T: OptTensor, activation: str, interleave: Optional[int] = None,
                  b1_EH: OptTensor = None, expert_T: OptTensor = None) -> Tensor:
    """a_TF = probs * act(h + b1[expert]) in fp32 math, returned in h's dtype (`probs_T` None means 1)."""
    f = ffn_width(h_TH.shape[1], activation, interleave)
    act, _, _ = act_and_partials(_with_bias(h_TH, b1_EH, expert_T), activation, interleave)
    a_TF = act.reshape(h_TH.shape[0], f)
    if probs_T is not None:
        a_TF = a_TF * probs_T.float()[:, None]
    return a_TF.to(h_TH.dtype)


def fused_backward(h_TH: Tensor, probs_T: OptTensor, da_TF: Tensor, activation: str, interleave: Optional[int] = None,
                   b1_EH: OptTensor = None, expert_T: OptTensor = None) -> tuple[Tensor, OptTensor, Tensor]:
    """Backward of `fused_forward` by recomputation from h: (dh_TH in h's dtype, dprobs_T in probs' dtype or
    None, a_TF recomputed in h's dtype). `da_TF` is the grad of a = p * act(h); dh is the grad w.r.t. h + b1
    (so also b1's per-row grad); dprobs_T = sum_f da * act(h)."""
    t, h = h_TH.shape
    f = ffn_width(h, activation, interleave)
    act, d_first, d_up = act_and_partials(_with_bias(h_TH, b1_EH, expert_T), activation, interleave)
    da32 = da_TF.float().reshape(act.shape)
    p32 = probs_T.float().reshape((t,) + (1,) * (act.dim() - 1)) if probs_T is not None else None
    dact = da32 * p32 if p32 is not None else da32
    dprobs_T = None
    if probs_T is not None:
        dprobs_T = (da32 * act).reshape(t, f).sum(dim=1).to(probs_T.dtype)
    if d_up is None:
        dh_TH = dact * d_first
    else:
        dh_TH = torch.empty(t, h, dtype=torch.float32, device=h_TH.device)
        dg_view, du_view = gate_up_views(dh_TH, interleave)
        dg_view.copy_(dact * d_first)
        du_view.copy_(dact * d_up)
    a = act * p32 if p32 is not None else act
    return dh_TH.reshape(t, h).to(h_TH.dtype), dprobs_T, a.reshape(t, f).to(h_TH.dtype)


def add_row_bias(y_TD: Tensor, probs_T: OptTensor, b2_ED: Tensor, expert_T: Tensor) -> Tensor:
    """y + probs * b2[expert] in fp32 math, in y's dtype (the Triton kernel does it in place, in one pass)."""
    bias_TD = b2_ED.float().index_select(0, expert_T.long())
    if probs_T is not None:
        bias_TD = bias_TD * probs_T.float()[:, None]
    return (y_TD.float() + bias_TD).to(y_TD.dtype)


# --- routing probs -----------------------------------------------------------------------------------
def scale_by_probs(z_TD: Tensor, probs_T: OptTensor) -> Tensor:
    """probs * z in fp32, back in z's dtype (a bf16 prob would lose ~3 digits of the routing weight)."""
    if probs_T is None:
        return z_TD
    return (z_TD.float() * probs_T.float()[:, None]).to(z_TD.dtype)


def unscale_grad(dy_TD: Tensor, z_TD: OptTensor, probs_T: OptTensor) -> tuple[Tensor, OptTensor]:
    """(dz, dprobs) for y = probs * z; padded rows (prob 0) get dz = 0, which keeps them out of wgrads."""
    if probs_T is None or z_TD is None:
        return dy_TD, None
    dz_TD = (dy_TD.float() * probs_T.float()[:, None]).to(dy_TD.dtype)
    dprobs_T = (dy_TD.float() * z_TD.float()).sum(dim=1).to(probs_T.dtype)
    return dz_TD, dprobs_T


# --- per-expert row segments -------------------------------------------------------------------------
def expert_of_row(tokens_per_expert_E: Tensor, rows: int) -> Tensor:
    """The expert index of every row `[T]` (int32), without a host sync: the counts stay a device tensor."""
    E = tokens_per_expert_E.shape[0]
    ids_E = torch.arange(E, device=tokens_per_expert_E.device, dtype=torch.int32)
    return torch.repeat_interleave(ids_E, tokens_per_expert_E.long(), output_size=rows)


def segment_sum(v_TX: Tensor, tokens_per_expert_E: Tensor) -> Tensor:
    """Per-expert row sums `[E, X]` in fp32 (bias grads), deterministic (no index_add atomics).

    On CUDA the counts stay on the device, so a step with expert biases captures in a CUDA graph: a Triton
    kernel summing each segment in row order (`kernels/segment_sum_triton.py`), or without Triton the product
    of a one-hot `[T, E]` matrix with the rows in fp32. Elsewhere `torch.segment_reduce` (on CUDA it copies
    the lengths to the host)."""
    if v_TX.is_cuda:
        if has_triton():
            from trainer.kernels import segment_sum_triton

            return segment_sum_triton.segment_sum(v_TX, tokens_per_expert_E)
        return segment_sum_one_hot(v_TX, tokens_per_expert_E)
    return torch.segment_reduce(v_TX.float(), "sum", lengths=tokens_per_expert_E.long(), axis=0)


def segment_sum_one_hot(v_TX: Tensor, tokens_per_expert_E: Tensor) -> Tensor:
    """`segment_sum` as the fp32 product of the rows' one-hot expert matrix `[E, T]` with `v` (CUDA without
    Triton: no host sync, deterministic, E times the adds of a segment sum). The counts must total T."""
    E = tokens_per_expert_E.shape[0]
    experts_T = expert_of_row(tokens_per_expert_E, v_TX.shape[0]).long()
    one_hot_ET = (experts_T[None, :] == torch.arange(E, device=v_TX.device)[:, None]).float()
    return one_hot_ET @ v_TX.float()


def bias_grads(dh_TH: Tensor, dz_TD: Tensor, tokens_per_expert_E: Tensor, b1_EH: OptTensor,
               b2_ED: OptTensor) -> tuple[OptTensor, OptTensor]:
    """(db1, db2) in the biases' dtypes from the grads of fc1's and fc2's outputs; None for an absent bias."""
    db1_EH = None if b1_EH is None else segment_sum(dh_TH, tokens_per_expert_E).to(b1_EH.dtype)
    db2_ED = None if b2_ED is None else segment_sum(dz_TD, tokens_per_expert_E).to(b2_ED.dtype)
    return db1_EH, db2_ED


def bias_grads_scaled(b1_EH: OptTensor, b2_ED: OptTensor, probs_T: OptTensor, tokens_per_expert_E: Tensor,
                      dy_TD: Tensor, dh_TH: Tensor) -> tuple[OptTensor, OptTensor]:
    """(db1, db2) of y = probs * (fc2(act(h)) + b2) from dy (the grad of y) and dh (of h + b1): y holds
    p * b2, so b2's grad sums p * dy (in fp32: the probs stay unrounded). For backends that apply the probs
    inside the MLP (fused, te), whose dz is never formed."""
    dy_scaled = dy_TD if probs_T is None or b2_ED is None else dy_TD.float() * probs_T.float()[:, None]
    return bias_grads(dh_TH, dy_scaled, tokens_per_expert_E, b1_EH, b2_ED)


def dprobs_with_b2(b2_ED: OptTensor, probs_T: OptTensor, expert_T: OptTensor, dy_TD: Tensor,
                   dprobs_T: OptTensor) -> OptTensor:
    """dprobs with p * b2's share added: y also holds p * b2, so d/dp gains dy . b2[expert] (fp32 math, in
    probs' dtype). `dprobs_T` is the MLP's own share (sum_f da * act(h))."""
    if b2_ED is not None:
        if expert_T is None:
            raise ValueError("a bias needs expert_T, the expert index of every row")
        if dprobs_T is not None and probs_T is not None:
            b2_rows = b2_ED.float().index_select(0, expert_T.long())
            dprobs_T = (dprobs_T.float() + (dy_TD.float() * b2_rows).sum(1)).to(probs_T.dtype)
    return dprobs_T
