"""`nvfp4`: E2M1 in 1x16 blocks with E4M3 block scales and an fp32 per-tensor scale (kinds/nvfp4.py).

Spec: NVIDIA's NVFP4 recipe (arXiv 2509.25149) and TE's NVFP4BlockScaling: weights use 16x16 tiles, so
the weight's columnwise copy is its exact transpose; activations and grads use 1x16 blocks, re-quantized
along tokens for the weight grad. Per-tensor global scales are per expert for a grouped weight and per
token group for grouped activations/grads. Not implemented here: TE's random Hadamard transform on the
weight-grad operands and stochastic rounding of grads (plain round-to-nearest-even). Token groups must
start on multiples of 16; `align_size` is 32 as in Megatron (the FP4 GEMM's K-granularity for the weight
grad, which contracts over tokens). Emulated on Hopper and CPU (FP4 GEMMs need sm100).
"""

from __future__ import annotations

from typing import Optional

from moectl.core.facts import RECIPE_ALIGN

from ..scheme import Scheme
from .base import Emulate, Recipe


class NVFP4Recipe(Recipe):
    """NVFP4 two-level block scaling."""

    name = "nvfp4"
    align_size = RECIPE_ALIGN["nvfp4"]

    def __init__(self, fp8_format: Optional[str] = None, emulate: Emulate = "auto") -> None:
        # fp8_format is meaningless here (every operand is e2m1); kept for get_recipe's uniform call
        super().__init__(fp8_format, emulate)

    def weight_scheme(self) -> Scheme:
        return Scheme("nvfp4", "e2m1", (16, 16))

    def activation_scheme(self) -> Scheme:
        return Scheme("nvfp4", "e2m1", (1, 16))

    def grad_scheme(self) -> Scheme:
        return Scheme("nvfp4", "e2m1", (1, 16))
