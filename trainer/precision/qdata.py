"""One quantized copy of a tensor (rowwise or columnwise): low-precision data plus its decode scales."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch


_STORED = ("data", "scale", "global_scale")


@dataclass
class QuantizedData:
    """Data and scales of one copy; the copy contracts along its last dim.

    data:         float8 `[..., M, K]`, or uint8 `[..., M, K/2]` of packed E2M1 codes (see fp4.py).
    scale:        decode scales (value = data * scale): fp32 `[...]` per tensor (or `[G]` per token
                  group), fp32 `[..., M, 1]` per row (or `[M, G]` per row and token group), fp32 /
                  e8m0 / e4m3 `[..., ceil(M/bh), ceil(K/bw)]` per block.
    global_scale: NVFP4 only: the fp32 per-tensor decode scale `[...]` (or `[G]`).
    gemm_scale:   optional, derived: `scale` already expanded to the layout the native grouped GEMM reads for
                  this copy of a token-grouped tensor (one per row `[T]`, or group-major `[G * M]`), written
                  by the quantize kernels in the launch that made `scale` (trainer/precision/native.py
                  expands `scale` itself when it is None). Not stored, gathered or counted: `tensors()`,
                  `map()` and `nbytes` leave it out.
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: Optional[torch.Tensor] = None
    gemm_scale: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The present stored tensors by field name, in a fixed order (data, scale, global_scale)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in _STORED and getattr(self, f.name) is not None}

    def map(self, fn) -> "QuantizedData":  # type: ignore[no-untyped-def]
        """A copy with `fn` applied to every present tensor."""
        return QuantizedData(**{name: fn(t) for name, t in self.tensors().items()})

    @property
    def nbytes(self) -> int:
        """Bytes held by data and scales."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())
