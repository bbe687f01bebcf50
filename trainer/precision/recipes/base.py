"""`Recipe`: what linear layers and expert backends call to run their GEMMs in low precision.

A recipe is three schemes (weight, activation, grad), a token alignment for grouped GEMMs, and the
GEMMs themselves:

    quantize_weight / quantize_activation / quantize_grad   -> QuantizedTensor
    fprop / dgrad / wgrad, grouped_fprop / grouped_dgrad / grouped_wgrad (no autograd; expert backends
        with an explicit backward call these)
    linear(x, w) / grouped_linear(x, w, offs)               autograd functions (linear.py)
    native_gemms(device) / native(device) / describe(device) which GEMMs are native here

The formats follow the config: `fp8: e4m3` uses E4M3 for every operand; `fp8: hybrid` uses E5M2 for the
grads (TE's Format.HYBRID). Subclasses (one file each) set the schemes.

`fast_accum_backward` (config `mixed_precision.fp8_fast_accum_backward`): native dgrad and wgrad GEMMs use
fast (non-split) accumulation, as torchao's fp8 MoE training does; the default keeps TE's split
accumulation there. fprop always accumulates fast. Emulated GEMMs are unaffected.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Sequence, Union

import torch

from moectl.core.errors import MoectlError

from .. import gemm
from ..groups import TokenGroups
from ..linear import grouped_linear as _grouped_linear
from ..linear import linear as _linear
from ..native import gemm_native
from ..quantize import quantize
from ..quantized_tensor import QuantizedTensor
from ..report import describe as _describe
from ..scheme import Scheme

Emulate = Literal["auto", "always", "never"]
GEMMS = ("fprop", "dgrad", "wgrad")


class Recipe:
    """Base class; see the module docstring. Subclasses define `name`, `align_size` and the schemes."""

    name: ClassVar[str]
    align_size: ClassVar[int]  # pad each expert's token count to a multiple of this (grouped GEMMs)

    def __init__(
        self, fp8_format: Optional[str] = "e4m3", emulate: Emulate = "auto", *, fast_accum_backward: bool = False
    ) -> None:
        if fp8_format not in ("e4m3", "hybrid", None):
            raise ValueError(f"fp8 format must be 'e4m3' or 'hybrid', got {fp8_format!r}")
        if emulate not in ("auto", "always", "never"):
            raise ValueError(f"emulate must be auto, always or never, got {emulate!r}")
        self.fp8_format = fp8_format
        self.emulate = emulate
        self.fast_accum_backward = bool(fast_accum_backward)

    # ---- schemes (subclasses) -------------------------------------------------------------------
    @property
    def grad_fmt(self) -> str:
        """Element format of grads: e5m2 under `hybrid`, else e4m3."""
        return "e5m2" if self.fp8_format == "hybrid" else "e4m3"

    def weight_scheme(self) -> Scheme:
        raise NotImplementedError

    def activation_scheme(self) -> Scheme:
        raise NotImplementedError

    def grad_scheme(self) -> Scheme:
        raise NotImplementedError

    # ---- state ----------------------------------------------------------------------------------
    def new_state(self, num_groups: Optional[int] = None) -> Any:
        """Per-layer scaling state (delayed scaling's amax histories); None for stateless recipes.

        `num_groups`: E for a grouped layer (one history per expert), None for a plain linear.
        """
        return None

    # ---- quantizers -----------------------------------------------------------------------------
    def quantize_weight(
        self,
        w: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        amax: Optional[torch.Tensor] = None,
        state: Any = None,
    ) -> QuantizedTensor:
        """Quantize a weight `[out, in]` or a grouped weight `[E, out, in]` in one call.

        Per-tensor recipes use one scale per expert. `amax` overrides the per-tensor amax (shape
        `w.shape[:-2]`), e.g. one all-reduced over the ranks that hold shards of `w`.
        """
        return quantize(w, self.weight_scheme(), rowwise=rowwise, columnwise=columnwise, amax=amax, recipe=self.name)

    def quantize_activation(
        self,
        x: torch.Tensor,
        *,
        offsets: Optional[torch.Tensor] = None,
        groups: Optional[TokenGroups] = None,
        rowwise: bool = True,
        columnwise: bool = True,
        state: Any = None,
        amax: Optional[torch.Tensor] = None,
    ) -> QuantizedTensor:
        """Quantize an activation `[T, in]` (with token groups for a grouped GEMM). `amax`: its per-tensor
        (per-group) amax when the producer already measured it (the fused activation kernel does)."""
        return quantize(
            x, self.activation_scheme(), rowwise=rowwise, columnwise=columnwise, offsets=offsets, groups=groups,
            amax=amax, recipe=self.name,
        )

    def quantize_grad(
        self,
        g: torch.Tensor,
        *,
        offsets: Optional[torch.Tensor] = None,
        groups: Optional[TokenGroups] = None,
        rowwise: bool = True,
        columnwise: bool = True,
        state: Any = None,
        amax: Optional[torch.Tensor] = None,
    ) -> QuantizedTensor:
        """Quantize an output grad `[T, out]` (with token groups for a grouped GEMM); `amax` as for activations."""
        return quantize(
            g, self.grad_scheme(), rowwise=rowwise, columnwise=columnwise, offsets=offsets, groups=groups,
            amax=amax, recipe=self.name,
        )

    # ---- device ---------------------------------------------------------------------------------
    @property
    def mode(self) -> gemm.Mode:
        """The GEMM mode from `emulate`: auto -> auto, always -> emulate, never -> native."""
        return {"auto": "auto", "always": "emulate", "never": "native"}[self.emulate]  # type: ignore[return-value]

    def native_gemms(self, device: Union[torch.device, str, None]) -> dict[str, bool]:
        """Which of the six GEMMs have a native kernel on `device` for this recipe's formats.

        Keys: "linear.fprop", "linear.dgrad", "linear.wgrad", "grouped.fprop", "grouped.dgrad",
        "grouped.wgrad". Shape limits (dims multiple of 16) are checked per call; a GEMM whose shapes do
        not fit runs emulated under `emulate: auto`.
        """
        w, a, g = self.weight_scheme(), self.activation_scheme(), self.grad_scheme()
        pairs = {"fprop": (a, w), "dgrad": (g, w), "wgrad": (g, a)}
        out = {}
        for grouped, prefix in ((False, "linear"), (True, "grouped")):
            for name, (s1, s2) in pairs.items():
                ok = self.emulate != "always" and s1.kind == s2.kind
                ok = ok and gemm_native(s1.kind, s1.fmt, s2.fmt, name, grouped=grouped, device=device)
                out[f"{prefix}.{name}"] = ok
        return out

    def native(self, device: Union[torch.device, str, None]) -> bool:
        """True when every GEMM of this recipe runs natively on `device`."""
        return all(self.native_gemms(device).values())

    def check_device(self, device: Union[torch.device, str, None]) -> None:
        """Raise under `emulate: never` if some GEMM would have to be emulated on `device`."""
        if self.emulate == "never" and not self.native(device):
            missing = [k for k, v in self.native_gemms(device).items() if not v]
            raise MoectlError(
                f"fp8/fp4 recipe {self.name} has no native kernel on {torch.device(device or 'cpu')} for "
                f"{', '.join(missing)} and mixed_precision.emulate is 'never'",
                "set mixed_precision.emulate: auto to emulate them (exact, slower), or use a device that has them",
            )

    def describe(self, device: Union[torch.device, str, None]) -> str:
        """One line per GEMM family saying native or emulated (see report.py)."""
        return _describe(self, device)

    # ---- GEMMs without autograd -------------------------------------------------------------------
    def fprop(self, xq: QuantizedTensor, wq: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y = x W^T."""
        return gemm.fprop(xq, wq, out_dtype=out_dtype, mode=self.mode)

    def dgrad(self, gq: QuantizedTensor, wq: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        """dx = dy W."""
        return gemm.dgrad(gq, wq, out_dtype=out_dtype, mode=self.mode, fast_accum=self.fast_accum_backward)

    def wgrad(self, gq: QuantizedTensor, xq: QuantizedTensor) -> torch.Tensor:
        """dW = dy^T x, fp32."""
        return gemm.wgrad(gq, xq, mode=self.mode, fast_accum=self.fast_accum_backward)

    def grouped_fprop(self, xq: QuantizedTensor, wq: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Grouped y: token group e times W[e]^T."""
        return gemm.grouped_fprop(xq, wq, out_dtype=out_dtype, mode=self.mode)

    def grouped_dgrad(self, gq: QuantizedTensor, wq: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Grouped dx: token group e times W[e]."""
        return gemm.grouped_dgrad(gq, wq, out_dtype=out_dtype, mode=self.mode, fast_accum=self.fast_accum_backward)

    def grouped_wgrad(self, gq: QuantizedTensor, xq: QuantizedTensor) -> torch.Tensor:
        """Grouped dW `[E, out, in]`: fp32 emulated, bf16 from the native kernel (see native.py)."""
        return gemm.grouped_wgrad(gq, xq, mode=self.mode, fast_accum=self.fast_accum_backward)

    # ---- autograd -------------------------------------------------------------------------------
    def linear(
        self,
        x: torch.Tensor,
        w: Union[torch.Tensor, QuantizedTensor],
        *,
        param: Union[torch.Tensor, Sequence[torch.Tensor], None] = None,
        fuse_wgrad: bool = False,
        state: Any = None,
    ) -> torch.Tensor:
        """y `[..., out]` = x `[..., in]` @ w^T in this recipe (see linear.linear)."""
        return _linear(self, x, w, param=param, fuse_wgrad=fuse_wgrad, state=state)

    def grouped_linear(
        self,
        x: torch.Tensor,
        w: Union[torch.Tensor, QuantizedTensor],
        offs: torch.Tensor,
        *,
        param: Union[torch.Tensor, Sequence[torch.Tensor], None] = None,
        fuse_wgrad: bool = False,
        state: Any = None,
    ) -> torch.Tensor:
        """y `[T, out]`: rows of expert e (ending at offs[e]) times w[e]^T (see linear.grouped_linear)."""
        return _grouped_linear(self, x, w, offs, param=param, fuse_wgrad=fuse_wgrad, state=state)

    def __repr__(self) -> str:
        extra = ", fast_accum_backward=True" if self.fast_accum_backward else ""
        return f"{type(self).__name__}(fp8_format={self.fp8_format!r}, emulate={self.emulate!r}{extra})"
