"""One quantized copy of a tensor (rowwise or columnwise): low-precision data plus its decode scales."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch


@dataclass
class QuantizedData:
    """Data and scales of one copy; the copy contracts along its last dim.

    data:         float8 `[..., M, K]`, or uint8 `[..., M, K/2]` of packed E2M1 codes (see fp4.py).
    scale:        decode scales (value = data * scale): fp32 `[...]` per tensor (or `[G]` per token
                  group), fp32 `[..., M, 1]` per row (or `[M, G]` per row and token group), fp32 /
                  e8m0 / e4m3 `[..., ceil(M/bh), ceil(K/bw)]` per block.
    global_scale: NVFP4 only: the fp32 per-tensor decode scale `[...]` (or `[G]`).
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: Optional[torch.Tensor] = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The present tensors by field name, in a fixed order (data, scale, global_scale)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def map(self, fn) -> "QuantizedData":  # type: ignore[no-untyped-def]
        """A copy with `fn` applied to every present tensor."""
        return QuantizedData(**{name: fn(t) for name, t in self.tensors().items()})

    @property
    def nbytes(self) -> int:
        """Bytes held by data and scales."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())
