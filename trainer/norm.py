"""RMSNorm, computed in fp32 whatever the activation dtype (bf16 variance is too coarse).

A decoder's residual add and the norm after it are one call (`RMSNorm(x, delta)`), so a compiled norm
(`train.compile`) fuses the add into the norm's kernel, forward and backward: the residual stream is read
and written once per norm instead of once more by a separate add, and the grads that meet at the residual
are summed in the norm's backward kernel instead of by autograd's accumulation.
"""

from __future__ import annotations

from typing import Optional, Union, overload

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * weight over the last dimension, in fp32, returned in x's dtype.

    A function as well as a module, so code that must not call the module (a compiled region, where the
    module's hooks would be traced) computes the same bits.
    """
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(s, rms_norm(s))` with `s = x + delta`, computed (and rounded) as a separate add would."""
    s = x + delta
    return s, rms_norm(s, weight, eps)


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, over the last dimension; `forward(x, delta)` adds a residual branch first."""

    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    @overload
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...
    @overload
    def forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, delta: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`norm(x)`; with `delta`, `(x + delta, norm(x + delta))` (the residual add fused into the norm)."""
        if delta is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, delta, self.weight, self.eps)
