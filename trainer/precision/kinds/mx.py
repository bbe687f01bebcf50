"""MXFP8: 1x32 blocks of FP8 sharing one E8M0 (power-of-two) scale.

Spec: OCP "Microscaling Formats (MX) Specification" v1.0 (2023), section 6.3 "conversion from vectors of
high-precision values": for a block V of k=32 values,

    X = 2^(floor(log2(max_i |V_i|)) - emax_elem)       (emax_elem = 8 for E4M3, 15 for E5M2)
    P_i = quantize_to_element_format(V_i / X)          (round-to-nearest-even, saturating to +-max)

Scale rounding: the default `floor` is the OCP rule above. Because FP8's max is 1.75 * 2^emax, a block
whose amax mantissa exceeds 1.75 (e.g. amax 500 -> X = 1, 500 / 1 > 448) saturates its largest values;
NVIDIA's MXFP8 pretraining recipe (arXiv 2506.08027, "Recipes for Pre-training LLMs with MXFP8") rounds
the scale UP instead, X = 2^ceil(log2(amax / FP8_MAX)), which never saturates and is what TE's
MXFP8BlockScaling and cuBLAS on Blackwell compute (`cvt.rp.ue8m0`). That is `mx_rounding="rceil"`, with
TE's order of operations: amax * (1 / FP8_MAX) in fp32, then round up to a power of two. We default to
the spec's `floor` (moectl has no config key for it yet; see the report).

Edge cases (our choices, matching TE and torchao byte for byte):
- all-zero block (amax == 0): scale byte 0 (2^-127), data all zero: defined, finite, never NaN;
- exponents are clamped to E8M0's range [-127, 127] (a tiny amax gives 2^-127 and underflows to zero
  elements, which is the only thing a tiny block can do);
- amax inf or NaN: scale byte 255 (E8M0 NaN), so the whole block dequantizes to NaN (the OCP spec: "if
  the scale is NaN, all elements of the block are NaN"). Inf is not saturated here, unlike per-tensor FP8:
  the spec has no finite scale for it.

Elements are scaled by an exact power of two (`ldexp`), so no rounding happens before the element cast.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..blocks import block_amax, from_blocks, per_block, to_blocks
from ..formats import E8M0_MAX_EXP, E8M0_MIN_EXP, cast_to_fp8, e8m0_from_exponent, e8m0_to_float, fp8_format
from ..groups import Jagged
from ..qdata import QuantizedData
from ..scheme import Scheme


def scale_exponent(amax: torch.Tensor, emax_elem: int, fmax: float, rounding: str) -> torch.Tensor:
    """The unbiased E8M0 exponent (int32, clamped to [-127, 127]) for block amaxes (fp32).

    Zero amax gives -127 (scale byte 0); non-finite amax gives an arbitrary value the caller masks to NaN.
    """
    amax = amax.to(torch.float32)
    if rounding == "floor":
        # frexp: amax = m * 2^e with m in [0.5, 1) (exact, subnormals included) -> floor(log2 amax) = e - 1.
        _, e = torch.frexp(amax)
        exponent = e.to(torch.int32) - 1 - emax_elem
    elif rounding == "rceil":
        descale = amax * (torch.tensor(1.0, dtype=torch.float32) / fmax)
        m, e = torch.frexp(descale)
        # An exact power of two (m == 0.5) stays; anything above it rounds up to the next one.
        exponent = torch.where(m == 0.5, e - 1, e).to(torch.int32)
    else:
        raise ValueError(f"unknown MX scale rounding {rounding!r}; expected 'floor' or 'rceil'")
    exponent = torch.where(amax == 0, torch.full_like(exponent, E8M0_MIN_EXP), exponent)
    return exponent.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def quantize(
    x: torch.Tensor,
    scheme: Scheme,
    jagged: Optional[Jagged],
    *,
    amax: Optional[torch.Tensor] = None,
    encode_scale: Optional[torch.Tensor] = None,
) -> QuantizedData:
    """Quantize fp32 `x` `[..., M, K]`; scales e8m0 `[..., ceil(M/bh), ceil(K/32)]`."""
    if amax is not None or encode_scale is not None:
        raise ValueError("MX scaling computes its own scales")
    fmt = fp8_format(scheme.fmt)
    bh, bw = scheme.block
    M, K = x.shape[-2], x.shape[-1]
    amax_b = block_amax(x, bh, bw)
    exponent = scale_exponent(amax_b, fmt.emax, fmt.max, scheme.mx_rounding)
    nan = ~torch.isfinite(amax_b)
    # x / 2^exponent exactly; a NaN block is forced to NaN elements (the scale is NaN anyway).
    scaled = torch.ldexp(to_blocks(x, bh, bw), per_block(-exponent))
    scaled = torch.where(per_block(nan), torch.full_like(scaled, float("nan")), scaled)
    data = from_blocks(cast_to_fp8(scaled, fmt), M, K)
    return QuantizedData(data=data, scale=e8m0_from_exponent(exponent, nan))


def dequantize(q: QuantizedData, scheme: Scheme, jagged: Optional[Jagged], shape: torch.Size) -> torch.Tensor:
    """fp32 values: data * 2^scale (exact)."""
    bh, bw = scheme.block
    M, K = q.data.shape[-2], q.data.shape[-1]
    return from_blocks(to_blocks(q.data.to(torch.float32), bh, bw) * per_block(e8m0_to_float(q.scale)), M, K)
