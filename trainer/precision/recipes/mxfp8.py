"""`mxfp8`: OCP MX FP8, 1x32 blocks along the contraction dim with E8M0 scales (kinds/mx.py).

Spec: OCP Microscaling Formats (MX) v1.0; TE's MXFP8BlockScaling. Every operand has rowwise and
columnwise copies, each quantized from high precision along its own contraction dim (a 1x32 block's
transpose is a 32x1 block, a different grouping), which is why MXFP8 param gather gathers bf16 and
re-quantizes locally. E4M3 everywhere (E5M2 grads under `hybrid`, with emax 15).

Scale rounding defaults to the OCP spec's floor; `scale_rounding="rceil"` gives the round-up rule of
arXiv 2506.08027 / TE / Blackwell cuBLAS. Token groups must start on multiples of 32 (`align_size`,
Megatron's mxfp8 alignment). Emulated on Hopper and CPU (MX GEMMs need sm100).
"""

from __future__ import annotations

from typing import Optional

from moectl.core.facts import RECIPE_ALIGN

from ..scheme import Scheme
from .base import Emulate, Recipe

BLOCK = RECIPE_ALIGN["mxfp8"]  # the 1x32 scaling block, also the token-group multiple


class MXFP8Recipe(Recipe):
    """MXFP8 with 1x32 blocks."""

    name = "mxfp8"
    align_size = BLOCK

    def __init__(
        self,
        fp8_format: Optional[str] = "e4m3",
        emulate: Emulate = "auto",
        scale_rounding: str = "floor",
        *,
        fast_accum_backward: bool = False,
    ) -> None:
        super().__init__(fp8_format, emulate, fast_accum_backward=fast_accum_backward)
        if scale_rounding not in ("floor", "rceil"):
            raise ValueError(f"scale_rounding must be 'floor' (OCP) or 'rceil', got {scale_rounding!r}")
        self.scale_rounding = scale_rounding

    def weight_scheme(self) -> Scheme:
        return Scheme("mx", "e4m3", (1, BLOCK), mx_rounding=self.scale_rounding)  # type: ignore[arg-type]

    def activation_scheme(self) -> Scheme:
        return Scheme("mx", "e4m3", (1, BLOCK), mx_rounding=self.scale_rounding)  # type: ignore[arg-type]

    def grad_scheme(self) -> Scheme:
        return Scheme("mx", self.grad_fmt, (1, BLOCK), mx_rounding=self.scale_rounding)  # type: ignore[arg-type]
