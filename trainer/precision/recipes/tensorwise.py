"""fp8 `tensorwise`: current (just-in-time) per-tensor scaling, TE's Float8CurrentScaling.

Every operand gets one fp32 scale from its own amax at the moment it is quantized: scale = FP8_MAX / amax
(fp8_scale.py; no power-of-two rounding, as TE's default). A grouped weight has one scale per expert and
a grouped activation or grad one per token group, so a grouped GEMM equals the per-expert loop. The
columnwise copies are the rowwise bytes transposed (same scale). Native on sm89+ via `torch._scaled_mm`,
grouped on sm90 via `torch._scaled_grouped_mm` (e4m3 only: under `hybrid` the grouped backward GEMMs,
which take e5m2 grads, are emulated).
"""

from __future__ import annotations

from moectl.core.facts import RECIPE_ALIGN

from ..scheme import Scheme
from .base import Recipe


class TensorwiseRecipe(Recipe):
    """Per-tensor current scaling."""

    name = "tensorwise"
    align_size = RECIPE_ALIGN["tensorwise"]  # the fp8 grouped GEMM's token-group multiple

    def weight_scheme(self) -> Scheme:
        return Scheme("tensor", "e4m3")

    def activation_scheme(self) -> Scheme:
        return Scheme("tensor", "e4m3")

    def grad_scheme(self) -> Scheme:
        return Scheme("tensor", self.grad_fmt)  # type: ignore[arg-type]
