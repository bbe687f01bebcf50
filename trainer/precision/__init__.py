"""Low-precision training: formats, recipes, the quantized storage type, native and emulated GEMMs.

Entry points:
    get_recipe(cfg.mixed_precision) -> Recipe | None
    recipe.linear(x, w) / recipe.grouped_linear(x, w, offs)     autograd GEMMs for layers
    recipe.quantize_weight(w) -> QuantizedTensor                 params (one call for [E, out, in])
    QuantizedTensor.to_bytes() / from_bytes(buf, layout)         quantized params in flat byte buffers
    describe(recipe, device)                                     native vs emulated, printed by the run

Layout: formats.py / fp4.py (element and scale formats), fp8_scale.py (fp32 scale rule), scheme.py,
kinds/ (one quantizer per scaling kind), quantize.py, quantized_tensor.py, gemm.py (+ native.py),
linear.py (autograd), recipes/ (one file per recipe), report.py.
"""

from __future__ import annotations

from .quantize import quantize
from .quantized_tensor import ByteLayout, QuantizedTensor, Segment
from .qdata import QuantizedData
from .recipes import (
    BlockwiseRecipe,
    DelayedRecipe,
    DelayedState,
    MXFP8Recipe,
    NVFP4Recipe,
    Recipe,
    RowwiseRecipe,
    TensorwiseRecipe,
    get_recipe,
)
from .report import describe
from .scheme import Scheme

__all__ = [
    "BlockwiseRecipe",
    "ByteLayout",
    "DelayedRecipe",
    "DelayedState",
    "MXFP8Recipe",
    "NVFP4Recipe",
    "QuantizedData",
    "QuantizedTensor",
    "Recipe",
    "RowwiseRecipe",
    "Scheme",
    "Segment",
    "TensorwiseRecipe",
    "describe",
    "get_recipe",
    "quantize",
]
