"""A quantization scheme: how one GEMM operand (weight, activation or grad) is turned into low precision.

A recipe (see `recipes/`) is three schemes, one per operand role, plus which GEMM runs them. The kinds:

    tensor  one fp32 scale per tensor (per expert for a grouped [E, out, in] weight, per token group for
            the rows of a grouped activation): fp8 tensorwise/delayed (TE Float8CurrentScaling /
            DelayedScaling).
    row     one fp32 scale per row, along the contraction (last) dim: torchao's float8 ROWWISE.
    block   one fp32 scale per `block` tile, e.g. 1x128 or 128x128: DeepSeek-V3 / TE Float8BlockScaling.
    mx      one E8M0 scale per 1x32 block: OCP MX v1.0 (MXFP8), TE MXFP8BlockScaling.
    nvfp4   E2M1 elements, one E4M3 scale per 1x16 (or 16x16) block and one fp32 scale per tensor:
            NVIDIA's NVFP4 recipe (arXiv 2509.25149), TE NVFP4BlockScaling.

Orientation: a scheme always blocks along the LAST dim of the copy it quantizes, which is the GEMM's
contraction dim. The columnwise copy of a tensor is the same scheme applied to its transpose (TE's
"columnwise usage"), stored transposed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["tensor", "row", "block", "mx", "nvfp4"]
KINDS = ("tensor", "row", "block", "mx", "nvfp4")


@dataclass(frozen=True)
class Scheme:
    """How one operand is quantized (see the module docstring for the kinds)."""

    kind: Kind
    fmt: Literal["e4m3", "e5m2", "e2m1"]
    block: tuple[int, int] = (1, 1)  # tile (rows, cols) of the block/mx/nvfp4 kinds
    pow2: bool = False  # round fp32 scales down to powers of two (tensor/row/block kinds)
    mx_rounding: Literal["floor", "rceil"] = "floor"  # E8M0 exponent choice (mx kind), see kinds/mx.py

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown scheme kind {self.kind!r}")
        if (self.kind == "nvfp4") != (self.fmt == "e2m1"):
            raise ValueError("the nvfp4 kind and only it uses e2m1 elements")
        if self.kind in ("block", "mx", "nvfp4") and (self.block[0] < 1 or self.block[1] < 1):
            raise ValueError(f"bad block {self.block}")

    @property
    def blocked(self) -> bool:
        """Whether scales belong to tiles of `block` (block, mx, nvfp4) rather than tensors or rows."""
        return self.kind in ("block", "mx", "nvfp4")

    @property
    def transposable(self) -> bool:
        """Whether the columnwise copy is exactly the rowwise copy transposed (data and scales).

        True for one scale per tensor and for square 2-D tiles (128x128, 16x16): the tiles of the
        transpose are the transposed tiles, so they have the same amax and the same scale. False for rows
        and 1-D blocks, which must be re-quantized from high precision along the other dim.
        """
        return self.kind == "tensor" or (self.blocked and self.block[0] == self.block[1] and self.block[0] > 1)

    @property
    def packed(self) -> bool:
        """Whether two elements share a byte (E2M1)."""
        return self.fmt == "e2m1"

    def describe(self) -> str:
        """A short human description, e.g. 'e4m3, 1x32 blocks, e8m0 scales (floor)'."""
        if self.kind == "tensor":
            return f"{self.fmt}, per-tensor fp32 scale" + (" (pow2)" if self.pow2 else "")
        if self.kind == "row":
            return f"{self.fmt}, per-row fp32 scales" + (" (pow2)" if self.pow2 else "")
        tile = f"{self.block[0]}x{self.block[1]}"
        if self.kind == "block":
            return f"{self.fmt}, {tile} blocks, fp32 scales" + (" (pow2)" if self.pow2 else "")
        if self.kind == "mx":
            return f"{self.fmt}, {tile} blocks, e8m0 scales ({self.mx_rounding})"
        return f"e2m1, {tile} blocks, e4m3 scales + fp32 tensor scale"
