"""FP4 E2M1: element encoding with round-to-nearest-even, and two-per-byte packing.

Spec: OCP "Microscaling Formats (MX) Specification" v1.0, section 5.3.3 (FP4 E2M1): 1 sign, 2 exponent
bits (bias 1), 1 mantissa bit, no inf/NaN; magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}. The 4-bit code is
`sign << 3 | magnitude index`, so code k (0..7) is the k-th magnitude above and code 8 + k its negative.

Rounding: round-to-nearest, ties to the code with an even mantissa bit (even code), i.e. IEEE RNE on the
E2M1 grid: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. Magnitudes above 6
saturate to 6 (NVIDIA's `cvt.rn.satfinite.e2m1x2.f32`; TE's reference `cast_to_fp4x2`). E2M1 has no NaN:
a NaN element encodes as (signed) zero, and the NaN lives on in its block scale (see `kinds/nvfp4.py`).

Packing (checked against torch's own convention for `torch.float4_e2m1fn_x2`, which this build can hold
but not convert on CPU: `torch.testing._internal.common_quantized.pack_uint4` packs
`data[1::2] << 4 | data[::2]`): element 2i goes in the LOW nibble of byte i and element 2i+1 in the
high nibble, along the last dimension.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
# Code k -> magnitude; codes 8..15 are the negatives.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes, and whether a value exactly at the midpoint rounds up:
# it does when the upper neighbour has the even code (RNE), i.e. for 0.75 (-> code 2), 1.75 (-> 4) and
# 3.5 (-> 6); it stays down at 0.25 (-> 0), 1.25 (-> 2), 2.5 (-> 4) and 5 (-> 6).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, one per element, 0..15) of already-scaled fp32 values, RNE and saturating."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in _MIDPOINTS:
        # Each midpoint passed adds one code step; NaN passes none (comparisons are False).
        code += (mag >= mid if tie_up else mag > mid).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


_TABLES: dict[torch.device, torch.Tensor] = {}


def _e2m1_table(device: torch.device) -> torch.Tensor:
    """The E2M1 magnitudes on `device`, copied there once (a copy from the host cannot be captured in a graph)."""
    if device not in _TABLES:
        _TABLES[device] = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return _TABLES[device]


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (uint8 0..15)."""
    mag = _e2m1_table(codes.device)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes two per byte along the last dim (even length): element 2i low nibble, 2i+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got shape {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_e2m1`: uint8 [..., K/2] -> codes uint8 [..., K]."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def as_float4_x2(packed: torch.Tensor) -> torch.Tensor:
    """View packed bytes as `torch.float4_e2m1fn_x2` (for native FP4 GEMMs); same bytes, no copy."""
    return packed.view(torch.float4_e2m1fn_x2)
