"""Pure-torch reference of the fused expert activation: forward and a hand-written backward.

Legend: P routed rows (tokens after permute), H fc1 output width (2F for gated activations, F otherwise),
F expert ffn width, E experts.

The activation the fused expert MLP runs between its two grouped GEMMs is

    a_PF = probs_P[:, None] * act(h_PH + b1[expert_of_row])

with act one of
    swiglu        silu(g) * u
    quick_geglu   g * sigmoid(1.702 g) * u
    squared_relu  relu(h) ** 2            (not gated: H == F)

Why the routing probabilities are applied here: `fc2(p * a) == p * fc2(a)` row by row, so scaling the
F-wide activation costs nothing extra (it is written anyway), while scaling the D-wide expert output
would be one more pass over it. The fc2 bias does not commute that way: `p * (fc2(a) + b2)` needs
`p * b2` added after fc2, which the backend does in a cheap epilogue (see `fused_expert_mlp.py`).

Gate/up layout of fc1's rows: `[gate; up]` (gate rows 0..F-1, up rows F..2F-1), or, with
`interleave = I`, blocks `[g(I), u(I), g(I), u(I), ...]`: interleaved row `b*2I + h*I + o` holds
contiguous row `h*F + b*I + o` (h = 0 gate, 1 up). The reference reads both through views, with no copy.

The backward recomputes the activation from h (nothing F-wide is stored between forward and backward)
and returns the recomputed scaled activation too, because fc2's weight grad needs it.
This module is the CPU path of the `fused` backend and the oracle for the Triton kernels (`glu_triton.py`).
"""

from __future__ import annotations

import torch

ACTIVATIONS = ("swiglu", "quick_geglu", "squared_relu")
QUICK_GELU_ALPHA = 1.702


def is_gated(activation: str) -> bool:
    """True for activations that read a gate and an up half (H == 2F)."""
    check_activation(activation)
    return activation != "squared_relu"


def check_activation(activation: str) -> None:
    """Raise a clear error for an activation the kernels do not implement."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}; expected one of {ACTIVATIONS}")


def ffn_width(h_width: int, activation: str, interleave: int | None) -> int:
    """F from H, checking that the interleave block divides F."""
    gated = is_gated(activation)
    if gated and h_width % 2:
        raise ValueError(f"gated activation {activation!r} needs an even fc1 width, got {h_width}")
    f = h_width // 2 if gated else h_width
    if gated and interleave is not None and (interleave <= 0 or f % interleave):
        raise ValueError(f"glu_interleave_size={interleave} must be positive and divide the ffn width {f}")
    return f


def gate_up_views(h_PH: torch.Tensor, interleave: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a gated fc1 output, as views (no copy) in either layout."""
    p, h = h_PH.shape
    f = h // 2
    if interleave is None:
        return h_PH[:, :f], h_PH[:, f:]
    blocks_PBSI = h_PH.reshape(p, f // interleave, 2, interleave)  # S: 0 gate, 1 up
    return blocks_PBSI[:, :, 0, :], blocks_PBSI[:, :, 1, :]


def _with_bias(
    h_PH: torch.Tensor, bias_EH: torch.Tensor | None, expert_P: torch.Tensor | None
) -> torch.Tensor:
    """h + b1[expert_of_row] in fp32 (the kernels add the bias on load, so the stored h has none)."""
    h32_PH = h_PH.float()
    if bias_EH is None:
        return h32_PH
    if expert_P is None:
        raise ValueError("a bias needs expert_P, the expert index of every row")
    return h32_PH + bias_EH.float().index_select(0, expert_P)


def _act_and_grads(
    hb_PH: torch.Tensor, activation: str, interleave: int | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """act(h) [P, F] and its partial derivatives w.r.t. gate and up (or w.r.t. h when not gated).

    Returned derivatives have the shape of act (block-shaped [P, F/I, I] when interleaved).
    For squared_relu the second derivative slot is None.
    """
    if activation == "squared_relu":
        r = torch.relu(hb_PH)
        return r * r, 2.0 * r, None
    g, u = gate_up_views(hb_PH, interleave)
    scale = 1.0 if activation == "swiglu" else QUICK_GELU_ALPHA
    s = torch.sigmoid(scale * g)
    gs = g * s  # silu(g) for swiglu, quick_gelu(g) for quick_geglu
    dgs_dg = s + scale * gs * (1.0 - s)
    return gs * u, u * dgs_dg, gs


def glu_forward(
    h_PH: torch.Tensor,
    probs_P: torch.Tensor | None,
    activation: str,
    interleave: int | None = None,
    bias_EH: torch.Tensor | None = None,
    expert_P: torch.Tensor | None = None,
) -> torch.Tensor:
    """a_PF = probs * act(h + b1[expert]) in fp32 math, returned in h's dtype.

    `probs_P` None means 1 (no routing scale). `bias_EH`/`expert_P` are optional (fc1 bias).
    """
    ffn_width(h_PH.shape[1], activation, interleave)
    act, _, _ = _act_and_grads(_with_bias(h_PH, bias_EH, expert_P), activation, interleave)
    act_PF = act.reshape(h_PH.shape[0], -1)
    if probs_P is not None:
        act_PF = act_PF * probs_P.float()[:, None]
    return act_PF.to(h_PH.dtype)


def glu_backward(
    h_PH: torch.Tensor,
    probs_P: torch.Tensor | None,
    da_PF: torch.Tensor,
    activation: str,
    interleave: int | None = None,
    bias_EH: torch.Tensor | None = None,
    expert_P: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Backward of `glu_forward` by recomputation from h.

    `da_PF` is the grad of the scaled activation a = p * act(h). Returns
    (dh_PH in h's dtype, dprobs_P in probs' dtype or None, a_PF recomputed in h's dtype).
    dh is the grad w.r.t. h + b1 (so also b1's per-row grad); dprobs_P = sum_f da * act(h).
    """
    p, h = h_PH.shape
    ffn_width(h, activation, interleave)
    act, d_first, d_up = _act_and_grads(_with_bias(h_PH, bias_EH, expert_P), activation, interleave)
    da32 = da_PF.float().reshape(act.shape)
    p32 = probs_P.float().reshape((p,) + (1,) * (act.dim() - 1)) if probs_P is not None else None
    dact = da32 * p32 if p32 is not None else da32
    dprobs_P = None
    if probs_P is not None:
        dprobs_P = (da32 * act).reshape(p, -1).sum(dim=1).to(probs_P.dtype)
    if d_up is None:
        dh_PH = dact * d_first
    else:
        dh_PH = torch.empty(p, h, dtype=torch.float32, device=h_PH.device)
        dg_view, du_view = gate_up_views(dh_PH, interleave)
        dg_view.copy_(dact * d_first)
        du_view.copy_(dact * d_up)
    a = act * p32 if p32 is not None else act
    return dh_PH.reshape(p, h).to(h_PH.dtype), dprobs_P, a.reshape(p, -1).to(h_PH.dtype)
