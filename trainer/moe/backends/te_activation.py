"""a = probs * act(h) and its backward through Transformer Engine's row-scaled activation kernels.

Legend: T rows, H fc1 width (2F gated), F expert ffn width, I the gate/up interleave block.

    swiglu        tex.scaled_swiglu / tex.scaled_dswiglu
    quick_geglu   tex.scaled_clamped_swiglu / scaled_clamped_dswiglu with alpha 1.702, no clamp (limit = the
                  largest fp32, so min(x, limit) = x for every finite x) and no linear offset: g sigmoid(1.702 g) u
    squared_relu  tex.scaled_srelu / tex.scaled_dsrelu

The kernels (TE 2.20, common/activation/scaled_activation.cu) compute in fp32 and round once at the store,
reading the per-row scales (our routing probs, fp32 as the router made them) as they are; the backward
also returns d scale = sum_f da * act(h), which is our dprobs. So the probs are applied exactly as
`expert_math.fused_forward` applies them. Without probs the scale is 1 and no scale grad is computed.

fc1's row layout: TE's gated kernels read [gate | up] halves (TE calls them activation and linear), or
interleaved blocks [g(I), u(I), ...] natively when I is a multiple of 32 (the layout of
`moectl/core/facts.py`). Any other I is turned into halves here before the kernel (one copy of h) and the
grad turned back after it (one copy of dh), so callers always see h and dh in the stored layout.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from moectl.core.facts import QUICK_GELU_ALPHA

#: TE's interleaved GLU kernels take block sizes that are multiples of this (NVTE_CHECK in the kernel).
TE_INTERLEAVE_MULTIPLE = 32
_NO_CLAMP = float(torch.finfo(torch.float32).max)


def native_interleave(interleave: Optional[int]) -> int:
    """The interleave TE's kernel is told: I itself when it can read it, else 0 (halves, after `to_halves`)."""
    return interleave if interleave and interleave % TE_INTERLEAVE_MULTIPLE == 0 else 0


def to_halves(h_TH: torch.Tensor, interleave: int) -> torch.Tensor:
    """Interleaved blocks [g(I), u(I), g(I), ...] -> [gate | up] (a contiguous copy)."""
    t, h = h_TH.shape
    return h_TH.reshape(t, h // (2 * interleave), 2, interleave).transpose(1, 2).reshape(t, h)


def from_halves(h_TH: torch.Tensor, interleave: int) -> torch.Tensor:
    """[gate | up] -> interleaved blocks [g(I), u(I), ...] (a contiguous copy); inverse of `to_halves`."""
    t, h = h_TH.shape
    return h_TH.reshape(t, 2, h // (2 * interleave), interleave).transpose(1, 2).reshape(t, h)


def _layout(h_TH: torch.Tensor, interleave: Optional[int]) -> tuple[torch.Tensor, int, bool]:
    """(what the kernel reads, the interleave it is told, whether h was converted to halves here)."""
    native = native_interleave(interleave)
    if interleave and not native:
        return to_halves(h_TH, interleave), 0, True
    return h_TH.contiguous(), native, False


def act_forward(tex: Any, h_TH: torch.Tensor, scales_T: torch.Tensor, activation: str,
                interleave: Optional[int]) -> torch.Tensor:  # fmt: skip
    """a_TF = scales * act(h) in h's dtype (fp32 math, one rounding)."""
    if activation == "squared_relu":
        return tex.scaled_srelu(h_TH.contiguous(), scales_T, None)
    h_in, native, _ = _layout(h_TH, interleave)
    if activation == "swiglu":
        return tex.scaled_swiglu(h_in, scales_T, None, native)
    if activation == "quick_geglu":
        return tex.scaled_clamped_swiglu(h_in, scales_T, None, _NO_CLAMP, QUICK_GELU_ALPHA, 0.0, native)
    raise ValueError(f"the te backend has no kernel for activation {activation!r}")


def act_backward(tex: Any, da_TF: torch.Tensor, h_TH: torch.Tensor, scales_T: torch.Tensor, activation: str,
                 interleave: Optional[int], scale_grad: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:  # fmt: skip
    """(dh_TH in h's dtype and stored layout, d scales_T in the scales' dtype or None) for `act_forward`."""
    da = da_TF.contiguous()
    if activation == "squared_relu":
        dh, dscale = tex.scaled_dsrelu(da, h_TH.contiguous(), scales_T, None, scale_grad)
        return dh, dscale
    h_in, native, converted = _layout(h_TH, interleave)
    if activation == "swiglu":
        dh, dscale = tex.scaled_dswiglu(da, h_in, scales_T, None, native, scale_grad)
    elif activation == "quick_geglu":
        dh, dscale = tex.scaled_clamped_dswiglu(
            da, h_in, scales_T, None, _NO_CLAMP, QUICK_GELU_ALPHA, 0.0, native, scale_grad
        )  # fmt: skip
    else:
        raise ValueError(f"the te backend has no kernel for activation {activation!r}")
    if converted:
        assert interleave is not None
        dh = from_halves(dh, interleave)
    return dh, dscale
