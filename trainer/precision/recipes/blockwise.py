"""fp8 `blockwise`: DeepSeek-V3 scaling, 1x128 tiles for activations and grads, 128x128 for weights.

Spec: DeepSeek-V3 technical report (arXiv 2412.19437, section 3.3) and TE's Float8BlockScaling: E4M3
(E5M2 grads only under `hybrid`), fp32 scales constrained to powers of two (TE's default). The weight's
columnwise copy is its exact transpose (square tiles); activations and grads re-quantize 1x128 along
tokens for the weight grad, so every expert's token group must start on a multiple of 128
(`align_size`, what DeepGEMM's contiguous grouped layout also needs). Emulated on every device here.
"""

from __future__ import annotations

from moectl.core.facts import RECIPE_ALIGN

from ..scheme import Scheme
from .base import Recipe

BLOCK = RECIPE_ALIGN["blockwise"]  # 128x128 weight blocks, 1x128 activation blocks


class BlockwiseRecipe(Recipe):
    """128x128 weight tiles, 1x128 activation and grad tiles."""

    name = "blockwise"
    align_size = BLOCK  # a 1x128 block along tokens must not span two experts

    def weight_scheme(self) -> Scheme:
        return Scheme("block", "e4m3", (BLOCK, BLOCK), pow2=True)

    def activation_scheme(self) -> Scheme:
        return Scheme("block", "e4m3", (1, BLOCK), pow2=True)

    def grad_scheme(self) -> Scheme:
        return Scheme("block", self.grad_fmt, (1, BLOCK), pow2=True)  # type: ignore[arg-type]
