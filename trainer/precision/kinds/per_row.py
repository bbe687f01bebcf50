"""Per-row FP8 scaling along the contraction dim (fp8 `rowwise`).

Follows torchao's float8 ROWWISE recipe (torchao/float8/config.py `Float8LinearRecipeName.ROWWISE`):
every GEMM operand is e4m3 (or e5m2 grads under `hybrid` here) with one fp32 scale per row of the copy
being multiplied, i.e. per slice along the contraction dim, and scales rounded down to powers of two
(`round_scales_to_power_of_2=True`). The scale rule per row is TE's (fp8_scale.py).

For the columnwise copy of a jagged grouped activation (x^T `[D, T]`, contracting over tokens for the
weight grad) a row's scale must not span two experts: there is one scale per (row, token group), shape
`[D, G]`, as torchao's `triton_fp8_per_group_colwise_scales` does.
"""

from __future__ import annotations

from typing import Optional

import torch

from trainer.kernels.fp8_scale import inverse, scale_from_amax
from ..formats import cast_to_fp8, fp8_format
from ..groups import Jagged
from ..qdata import QuantizedData
from ..scheme import Scheme


def _broadcast(per_row: torch.Tensor, jagged: Optional[Jagged]) -> torch.Tensor:
    if jagged is not None and jagged.axis == -1:
        return per_row[:, jagged.groups.ids]  # [M, G] -> [M, T]
    return per_row  # [..., M, 1]


def quantize(
    x: torch.Tensor,
    scheme: Scheme,
    jagged: Optional[Jagged],
    *,
    amax: Optional[torch.Tensor] = None,
    encode_scale: Optional[torch.Tensor] = None,
) -> QuantizedData:
    """Quantize fp32 `x` `[..., M, K]`; decode scales `[..., M, 1]` (or `[M, G]` if tokens are columns)."""
    if encode_scale is not None:
        raise ValueError("per-row scaling computes its own scales")
    fmt = fp8_format(scheme.fmt)
    if amax is None:
        if jagged is not None and jagged.axis == -1:
            amax = jagged.groups.amax(x.abs(), dim=-1)  # [M, G]
        elif x.shape[-1] == 0:  # rows of no elements (the columnwise copy of an empty token batch)
            amax = x.new_zeros(*x.shape[:-1], 1)
        else:
            amax = x.abs().amax(dim=-1, keepdim=True)  # row groups do not matter: a row is one token
    scale = scale_from_amax(amax, fmt.max, scheme.pow2)
    data = cast_to_fp8(x * _broadcast(scale, jagged), fmt)
    return QuantizedData(data=data, scale=inverse(scale))


def dequantize(q: QuantizedData, scheme: Scheme, jagged: Optional[Jagged], shape: torch.Size) -> torch.Tensor:
    """fp32 values of a per-row copy."""
    return q.data.to(torch.float32) * _broadcast(q.scale, jagged)
