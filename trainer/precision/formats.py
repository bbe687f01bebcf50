"""The 8-bit element and scale formats: FP8 E4M3 / E5M2 and the E8M0 power-of-two scale.

Specs followed:
- FP8 E4M3 and E5M2: "FP8 Formats for Deep Learning" (Micikevicius et al., arXiv 2209.05433) and OCP
  "8-bit Floating Point Specification (OFP8)" rev 1.0. E4M3 is the `fn` variant (no infinities, one NaN
  mantissa pattern, max normal 448 = 1.75 * 2^8); E5M2 is IEEE-like (infinities, max normal
  57344 = 1.75 * 2^15).
- E8M0: OCP "Microscaling Formats (MX) Specification" v1.0, section 5.4.1: an unsigned biased exponent,
  bias 127, value 2^(byte - 127) for byte 0..254 (byte 0 is 2^-127), byte 255 is NaN, no zero, no sign.

Rounding and saturation (our choice, the same as Transformer Engine's and torchao's casts):
round-to-nearest-even, and *saturating*: finite values beyond the format's max, and +-inf, become +-max.
E5M2 could represent inf, but an overflowing scaled value is a scaling artefact, not a real infinity, and
TE's `satfinite` conversions and torchao's `to_fp8_saturated` clamp it too. NaN stays NaN (E4M3's single
NaN encoding 0x7F/0xFF, E5M2's quiet NaN), so a NaN in training data still poisons the loss and is caught
by the trainer's non-finite check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.kernels.fp8_scale import FLT_MAX  # noqa: F401 - re-exported: the formats' overflow value

E8M0_BIAS = 127
E8M0_NAN = 255  # the one E8M0 byte that is not a power of two
E8M0_MIN_EXP = -127  # byte 0
E8M0_MAX_EXP = 127  # byte 254


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 element format: its torch dtype, largest finite value and the exponent of that value."""

    name: str
    dtype: torch.dtype
    max: float
    emax: int  # floor(log2(max)): the `emax_elem` of the OCP MX spec (section 5.3, table 1)


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 8)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 15)
FP8_FORMATS: dict[str, Fp8Format] = {"e4m3": E4M3, "e5m2": E5M2}


def fp8_format(name: str) -> Fp8Format:
    """The FP8 format called `name` ('e4m3' or 'e5m2')."""
    try:
        return FP8_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown fp8 format {name!r}; expected one of {sorted(FP8_FORMATS)}") from None


def cast_to_fp8(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Round already-scaled values to `fmt`: round-to-nearest-even, saturating, NaN kept.

    `x` should be fp32 (the scaled values); the clamp first makes out-of-range values and +-inf land on
    +-max rather than relying on the cast's overflow behaviour, which differs across torch versions and
    between E4M3 (no inf) and E5M2 (has inf). `torch.clamp` propagates NaN.
    """
    return x.clamp(-fmt.max, fmt.max).to(fmt.dtype)


def e8m0_from_exponent(exponent: torch.Tensor, nan: torch.Tensor | None = None) -> torch.Tensor:
    """E8M0 scales (dtype float8_e8m0fnu) holding 2^exponent; entries where `nan` is True become NaN.

    `exponent` is an integer tensor; it is clamped to E8M0's range [-127, 127]. Built from the biased byte
    directly (not by casting a float) so no conversion rounding can move the scale.
    """
    biased = (exponent.to(torch.int32).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP) + E8M0_BIAS).to(torch.uint8)
    if nan is not None:
        biased = torch.where(nan, torch.full_like(biased, E8M0_NAN), biased)
    return biased.view(torch.float8_e8m0fnu)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """The fp32 value of E8M0 scales: 2^(byte-127), exactly; NaN for byte 255.

    Computed from the byte with `ldexp` rather than the dtype cast so the result is exact for byte 0
    (2^-127, an fp32 subnormal) on every backend.
    """
    biased = scale.view(torch.uint8).to(torch.int32)
    value = torch.ldexp(torch.ones_like(biased, dtype=torch.float32), biased - E8M0_BIAS)
    return torch.where(biased == E8M0_NAN, torch.full_like(value, float("nan")), value)
