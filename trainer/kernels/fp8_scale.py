"""The fp32 scale of the FP8 kinds with fp32 scales (tensor, row, block): scale = FP8_MAX / amax.

The eager rule, and the reference the fused quantize kernel (`fp8_quant_triton.py`) matches bit for bit.

Follows Transformer Engine's `compute_scale_from_amax` (transformer_engine/common/recipe/
recipe_common.cuh), the rule behind Float8CurrentScaling, DelayedScaling and Float8BlockScaling:

    amax == 0, inf or NaN  -> scale 1 (an all-zero tensor quantizes to zeros with a defined scale; a
                              non-finite one keeps its NaNs, see formats.cast_to_fp8)
    otherwise              -> scale = fmax / amax, correctly rounded fp32 division
    scale == inf           -> FLT_MAX (amax so small that fmax / amax overflows fp32)
    pow2                   -> scale rounded DOWN to a power of two (keep the exponent bits, drop the
                              mantissa), so amax * scale still fits and the inverse scale is exact.

`scale` multiplies high-precision values before the cast (the "encode" scale); what is stored with the
FP8 data and multiplies it back is `1 / scale` (TE's `scale_inv`, torch._scaled_mm's `scale_a/scale_b`).
"""

from __future__ import annotations

import torch

FLT_MAX = torch.finfo(torch.float32).max  # the largest finite fp32, what an overflowing scale becomes


def scale_from_amax(amax: torch.Tensor, fmax: float, pow2: bool = False) -> torch.Tensor:
    """Encode scale(s) for fp32 `amax` (any shape) and a format whose largest value is `fmax`."""
    amax = amax.to(torch.float32)
    # new_full, not torch.tensor(..., device=): a fill kernel, where torch.tensor copies from the host (which
    # a CUDA graph capture refuses)
    scale = amax.new_full((), fmax) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    bad = (amax == 0) | ~torch.isfinite(amax)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    if pow2:
        scale = (scale.view(torch.int32) & ~0x7FFFFF).view(torch.float32)
    return scale


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """The stored decode scale `1 / scale` (fp32)."""
    return torch.reciprocal(scale)
