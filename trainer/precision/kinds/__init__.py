"""The quantization kinds, one module each, behind one interface (see `scheme.Scheme`):

    quantize(x_fp32 [..., M, K], scheme, jagged, *, amax=None, encode_scale=None) -> QuantizedData
    dequantize(q, scheme, jagged, shape) -> fp32 [..., M, K]
    transpose(q, scheme) -> QuantizedData        (only where `scheme.transposable`)
"""

from __future__ import annotations

from types import ModuleType

from . import block_fp8, mx, nvfp4, per_row, per_tensor

KIND_MODULES: dict[str, ModuleType] = {
    "tensor": per_tensor,
    "row": per_row,
    "block": block_fp8,
    "mx": mx,
    "nvfp4": nvfp4,
}

__all__ = ["KIND_MODULES"]
