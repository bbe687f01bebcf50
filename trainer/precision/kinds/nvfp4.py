"""NVFP4: E2M1 elements in 1x16 blocks (16x16 tiles for weights) with E4M3 block scales and one fp32
per-tensor scale (two-level scaling).

Spec: NVIDIA, "Pretraining Large Language Models with NVFP4" (arXiv 2509.25149, section 2 and appendix),
and the reference TE checks its kernels against (transformer_engine/pytorch/custom_recipes/
quantization_nvfp4.py `NVFP4QuantizerRef`, kernels in common/cast/nvfp4/core_nvfp4.cuh). In fp32:

    S_enc   = min(448 * 6 / amax_tensor, FLT_MAX); 1 if amax_tensor is 0 or the result is 0
              (global encode scale; the stored global decode scale is 1 / S_enc ~ amax / (6 * 448))
    s_block = e4m3_sat_rne(min(amax_block * (S_enc * (1/6)), FLT_MAX))      (stored block decode scale)
    enc     = min(1 / (fp32(s_block) * (1 / S_enc)), FLT_MAX)               (per-block encode scale)
    q       = e2m1_rne_sat(clamp(x * enc, -6, 6))
    x_hat   = (e2m1(q) * fp32(s_block)) * (1 / S_enc)                       (dequantize)

The multiply orders are TE's ("fold the FP4 reciprocal into the global scale multiplier"), so our bytes
match TE's reference quantizer. Not implemented (TE's training recipe adds them on top): random Hadamard
transforms of the wgrad operands and stochastic rounding of grads; plain RNE everywhere here.

Edge cases: an all-zero block gets s_block = 0, enc = FLT_MAX and zero elements (never NaN). A NaN in the
tensor: amax_tensor is NaN -> S_enc = 1 (our choice; TE's kernel gets FLT_MAX from `fminf`), the NaN
block's s_block is E4M3 NaN, so that block dequantizes to NaN and the loss shows it. +-inf saturates:
its block scale clamps to 448 and the elements to +-6.

2-D (16x16) tiles: one block scale per tile; the scale grid is `[ceil(M/16), ceil(K/16)]`, and the
columnwise copy is the exact transpose (same tiles, same amax), which is why NVIDIA uses 2-D blocks for
weights ("consistent representations across the forward and backward passes").
"""

from __future__ import annotations

from typing import Optional

import torch

from ..blocks import block_amax, from_blocks, per_block, to_blocks, transposed
from ..formats import E4M3, FLT_MAX, cast_to_fp8
from ..fp4 import E2M1_MAX, decode_e2m1, encode_e2m1, pack_e2m1, unpack_e2m1
from ..groups import Jagged
from ..qdata import QuantizedData
from ..scheme import Scheme
from .per_tensor import broadcast, tensor_amax

GLOBAL_NUMERATOR = E4M3.max * E2M1_MAX  # 448 * 6 = 2688, exact in fp32


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 2688 / amax (fp32), FLT_MAX if that overflows, 1 for a zero or non-finite amax."""
    amax = amax.to(torch.float32)
    s = amax.new_full((), GLOBAL_NUMERATOR, dtype=torch.float32) / amax  # a fill, not a host copy (CUDA graphs)
    s = torch.clamp(s, max=FLT_MAX)
    bad = (amax == 0) | ~torch.isfinite(amax) | (s == 0)
    return torch.where(bad, torch.ones_like(s), s)


def _block_grid(per_element: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    """A value constant over every block (a per-token-group scale with aligned groups), on the block grid."""
    return to_blocks(per_element, bh, bw)[..., :, 0, :, 0]


def quantize(
    x: torch.Tensor,
    scheme: Scheme,
    jagged: Optional[Jagged],
    *,
    amax: Optional[torch.Tensor] = None,
    encode_scale: Optional[torch.Tensor] = None,
) -> QuantizedData:
    """Quantize fp32 `x` `[..., M, K]` (K even) into packed E2M1 `[..., M, K/2]` + scales.

    `amax` optionally overrides the per-tensor amax (shape `[...]` or `[G]`).
    """
    if encode_scale is not None:
        raise ValueError("NVFP4 derives its scales from amaxes")
    bh, bw = scheme.block
    M, K = x.shape[-2], x.shape[-1]
    if jagged is not None and jagged.axis == -2 and bh != 1:
        raise ValueError("2-D NVFP4 tiles cannot be used on token rows of a grouped activation")
    if amax is None:
        amax = tensor_amax(x, jagged)
    s_enc = global_encode_scale(amax)
    g_dec = torch.reciprocal(s_enc)
    if jagged is None:
        s_enc_b = s_enc.unsqueeze(-1).unsqueeze(-1)  # [..., 1, 1] broadcasts over the block grid
        g_dec_b = g_dec.unsqueeze(-1).unsqueeze(-1)
    else:
        grid_shape = (M, K)
        s_enc_b = _block_grid(broadcast(s_enc, jagged).expand(grid_shape), bh, bw)
        g_dec_b = _block_grid(broadcast(g_dec, jagged).expand(grid_shape), bh, bw)
    inv6 = torch.tensor(1.0, dtype=torch.float32) / E2M1_MAX
    s_block = cast_to_fp8(torch.clamp(block_amax(x, bh, bw) * (s_enc_b * inv6), max=FLT_MAX), E4M3)
    enc = torch.clamp(torch.reciprocal(s_block.to(torch.float32) * g_dec_b), max=FLT_MAX)
    scaled = torch.clamp(to_blocks(x, bh, bw) * per_block(enc), -E2M1_MAX, E2M1_MAX)
    codes = from_blocks(encode_e2m1(scaled), M, K)
    return QuantizedData(data=pack_e2m1(codes), scale=s_block, global_scale=g_dec)


def dequantize(q: QuantizedData, scheme: Scheme, jagged: Optional[Jagged], shape: torch.Size) -> torch.Tensor:
    """fp32 values: (e2m1 * block scale) * global decode scale."""
    bh, bw = scheme.block
    values = decode_e2m1(unpack_e2m1(q.data))
    M, K = values.shape[-2], values.shape[-1]
    blocked = from_blocks(to_blocks(values, bh, bw) * per_block(q.scale.to(torch.float32)), M, K)
    assert q.global_scale is not None
    return blocked * broadcast(q.global_scale, jagged)


def transpose(q: QuantizedData, scheme: Scheme) -> QuantizedData:
    """Columnwise copy of 16x16 tiles: codes, the tile grid of scales transposed; same global scale."""
    if scheme.block[0] != scheme.block[1]:
        raise ValueError(f"a {scheme.block} NVFP4 copy cannot be transposed; re-quantize from high precision")
    codes = transposed(unpack_e2m1(q.data))
    assert q.global_scale is not None
    return QuantizedData(
        data=pack_e2m1(codes),
        scale=transposed(q.scale),
        global_scale=q.global_scale.clone(),
    )

