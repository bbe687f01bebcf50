"""Per-tensor FP8 scaling: one fp32 scale per tensor (fp8 `tensorwise` current scaling and `delayed`).

Spec: "FP8 Formats for Deep Learning" (arXiv 2209.05433) per-tensor scaling; the scale rule is TE's
`compute_scale_from_amax` (see fp8_scale.py): scale = FP8_MAX / amax (fp32), data = sat_rne(x * scale),
stored decode scale = 1 / scale. For a batch of tensors `[..., M, K]` (a grouped `[E, out, in]` weight)
there is one scale per leading index, so each expert equals its own per-expert quantization bitwise; for
a jagged grouped activation there is one scale per token group.

`amax` may be passed in (e.g. all-reduced over data-parallel ranks for a sharded param), and so may the
encode scale itself (delayed scaling picks it from an amax history).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..blocks import transposed
from trainer.kernels.fp8_scale import inverse, scale_from_amax
from ..formats import cast_to_fp8, fp8_format
from ..groups import Jagged
from ..qdata import QuantizedData
from ..scheme import Scheme


def tensor_amax(x: torch.Tensor, jagged: Optional[Jagged]) -> torch.Tensor:
    """max|x| per tensor: `[...]` for `[..., M, K]`, or `[G]` per token group of a jagged 2-D copy."""
    if jagged is None:
        if x.numel() == 0:  # an expert with no tokens: amax 0, so scale 1 and no data
            return x.new_zeros(x.shape[:-2])
        return x.abs().amax(dim=(-2, -1))
    # Reduce the non-token axis first, then take the max within each group along the token axis.
    per_token = x.abs().amax(dim=-1 if jagged.axis == -2 else -2)
    return jagged.groups.amax(per_token, dim=0)


def broadcast(per_tensor: torch.Tensor, jagged: Optional[Jagged]) -> torch.Tensor:
    """Shape per-tensor values to broadcast over the `[..., M, K]` copy."""
    if jagged is None:
        return per_tensor.unsqueeze(-1).unsqueeze(-1)
    return jagged.per_token(per_tensor)


def quantize(
    x: torch.Tensor,
    scheme: Scheme,
    jagged: Optional[Jagged],
    *,
    amax: Optional[torch.Tensor] = None,
    encode_scale: Optional[torch.Tensor] = None,
) -> QuantizedData:
    """Quantize fp32 `x` `[..., M, K]`; the decode scale has the per-tensor shape `[...]` (or `[G]`)."""
    fmt = fp8_format(scheme.fmt)
    if encode_scale is None:
        if amax is None:
            amax = tensor_amax(x, jagged)
        encode_scale = scale_from_amax(amax, fmt.max, scheme.pow2)
    encode_scale = encode_scale.to(torch.float32)
    data = cast_to_fp8(x * broadcast(encode_scale, jagged), fmt)
    return QuantizedData(data=data, scale=inverse(encode_scale))


def dequantize(q: QuantizedData, scheme: Scheme, jagged: Optional[Jagged], shape: torch.Size) -> torch.Tensor:
    """fp32 values of a per-tensor copy."""
    return q.data.to(torch.float32) * broadcast(q.scale, jagged)


def transpose(q: QuantizedData, scheme: Scheme) -> QuantizedData:
    """The columnwise copy from the rowwise one: the same bytes transposed, the same scale (exact).

    On CUDA the bytes move through one tiled Triton kernel per tensor (a grouped `[E, out, in]` weight
    included; `trainer/kernels/fp8_transpose_triton.py`): eager torch's strided 1-byte copy reaches a
    fraction of the bandwidth. Bitwise the same bytes either way.
    """
    if q.data.is_cuda:
        from trainer.kernels.fp8_transpose_triton import transpose_last2  # lazy: Triton only where used

        return QuantizedData(data=transpose_last2(q.data), scale=q.scale.clone())
    return QuantizedData(data=transposed(q.data), scale=q.scale.clone())
