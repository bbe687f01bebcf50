"""Block-scaled FP8 with fp32 scales (fp8 `blockwise`): DeepSeek-V3 style 1x128 / 128x128 tiles.

Spec: DeepSeek-V3 technical report (arXiv 2412.19437, section 3.3.2): activations scaled per 1x128 tile
(per token per 128 channels), weights per 128x128 block, E4M3 everywhere. TE implements it as
Float8BlockScaling (transformer_engine/common/recipe: 1-D blocks for inputs and grads, 2-D for weights),
whose fp32 scales are by default constrained to powers of two; we follow that default (`scheme.pow2`):
scale = pow2_floor(FP8_MAX / block_amax) by TE's rule (fp8_scale.py), so the decode scale is exact.

A ragged edge (a dim that is not a multiple of the block) is a partial block (blocks.py). Jagged grouped
activations need no special case: a 1x128 row block lies inside one token, and for the columnwise copy
the groups start on multiples of 128 (checked by the caller), so no block spans two experts.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..blocks import block_amax, from_blocks, per_block, to_blocks, transposed
from trainer.kernels.fp8_scale import inverse, scale_from_amax
from ..formats import cast_to_fp8, fp8_format
from ..groups import Jagged
from ..qdata import QuantizedData
from ..scheme import Scheme


def quantize(
    x: torch.Tensor,
    scheme: Scheme,
    jagged: Optional[Jagged],
    *,
    amax: Optional[torch.Tensor] = None,
    encode_scale: Optional[torch.Tensor] = None,
) -> QuantizedData:
    """Quantize fp32 `x` `[..., M, K]`; decode scales `[..., ceil(M/bh), ceil(K/bw)]` fp32."""
    if amax is not None or encode_scale is not None:
        raise ValueError("block scaling computes its own scales")
    fmt = fp8_format(scheme.fmt)
    bh, bw = scheme.block
    M, K = x.shape[-2], x.shape[-1]
    scale = scale_from_amax(block_amax(x, bh, bw), fmt.max, scheme.pow2)
    data = from_blocks(cast_to_fp8(to_blocks(x, bh, bw) * per_block(scale), fmt), M, K)
    return QuantizedData(data=data, scale=inverse(scale))


def dequantize(q: QuantizedData, scheme: Scheme, jagged: Optional[Jagged], shape: torch.Size) -> torch.Tensor:
    """fp32 values of a block-scaled copy."""
    bh, bw = scheme.block
    M, K = q.data.shape[-2], q.data.shape[-1]
    return from_blocks(to_blocks(q.data.to(torch.float32), bh, bw) * per_block(q.scale), M, K)


def transpose(q: QuantizedData, scheme: Scheme) -> QuantizedData:
    """Columnwise copy of square tiles: data and the tile grid of scales transposed (exact)."""
    if scheme.block[0] != scheme.block[1]:
        raise ValueError(f"a {scheme.block} block copy cannot be transposed; re-quantize from high precision")
    return QuantizedData(
        data=transposed(q.data), scale=transposed(q.scale)
    )
