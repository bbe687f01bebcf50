"""fp8 `rowwise`: one scale per row along the contraction dim, torchao's float8 ROWWISE recipe.

All operands e4m3 (e5m2 grads under `hybrid`), scales per row of whichever copy a GEMM contracts, rounded
down to powers of two as torchao does. The columnwise copies are re-quantized from high precision along
the other dim (TE/torchao do the same); for a grouped activation they are per (feature, expert), so no
scale spans two experts (kinds/per_row.py). Native: `torch._scaled_mm` rowwise (sm89+, e4m3, bf16 out)
and `torch._scaled_grouped_mm` (sm90); with e5m2 grads the backward GEMMs are emulated.
"""

from __future__ import annotations

from moectl.core.facts import RECIPE_ALIGN

from ..scheme import Scheme
from .base import Recipe


class RowwiseRecipe(Recipe):
    """Per-row scaling along the contraction dim."""

    name = "rowwise"
    align_size = RECIPE_ALIGN["rowwise"]  # torch._scaled_grouped_mm needs token groups that are multiples of 16

    def weight_scheme(self) -> Scheme:
        return Scheme("row", "e4m3", pow2=True)

    def activation_scheme(self) -> Scheme:
        return Scheme("row", "e4m3", pow2=True)

    def grad_scheme(self) -> Scheme:
        return Scheme("row", self.grad_fmt, pow2=True)  # type: ignore[arg-type]
