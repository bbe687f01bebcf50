"""The emulation report: which GEMMs of a recipe run on native kernels on this device, which are emulated.

The run prints it at start so a number never silently comes from emulation (architecture.md, "Precision
and the emulation policy"). Emulation is exact, not approximate: the real low-precision values and
scales are computed, dequantized and multiplied in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import torch

from .native import capability

if TYPE_CHECKING:
    from .recipes.base import Recipe

KERNELS = {"linear": "torch._scaled_mm", "grouped": "torch._scaled_grouped_mm / moectl's Triton"}


def _device_name(device: Union[torch.device, str, None]) -> str:
    dev = torch.device(device) if device is not None else torch.device("cpu")
    cc = capability(dev)
    return f"{dev} (sm{cc[0]}{cc[1]})" if cc else str(dev)


def describe(recipe: Optional["Recipe"], device: Union[torch.device, str, None]) -> str:
    """A few lines: the recipe, its formats, and native/emulated for each GEMM family on `device`."""
    where = _device_name(device)
    if recipe is None:
        return f"precision: no fp8/fp4 recipe; linear layers run in the model dtype on {where}"
    fmt = recipe.fp8_format or "fp4"
    lines = [
        f"precision: {recipe.name} ({fmt}) on {where}, emulate={recipe.emulate}",
        f"  weights: {recipe.weight_scheme().describe()}",
        f"  activations: {recipe.activation_scheme().describe()}",
        f"  grads: {recipe.grad_scheme().describe()}",
    ]
    gemms = recipe.native_gemms(device)
    for family in ("linear", "grouped"):
        parts = []
        for name in ("fprop", "dgrad", "wgrad"):
            parts.append(f"{name} {'native' if gemms[f'{family}.{name}'] else 'emulated'}")
        native_any = any(gemms[f"{family}.{n}"] for n in ("fprop", "dgrad", "wgrad"))
        kernel = f" via {KERNELS[family]}" if native_any else ""
        lines.append(f"  {family} GEMMs: {', '.join(parts)}{kernel}")
    if any(gemms.values()):
        backward = "fast (fp8_fast_accum_backward)" if recipe.fast_accum_backward else "split (precise)"
        lines.append(f"  native accumulation: fprop fast, dgrad and wgrad {backward}")
        if recipe.weight_scheme().kind == "tensor" and gemms["grouped.dgrad"]:  # grouped: sm90 and newer
            lines.append(
                "  expert GEMMs by moectl's Triton fp8 kernels where they fit: e5m2-grad (hybrid) data and weight "
                "grads, precise e4m3 data grads at min(N, K) < 2048, weight grads summed into main_grad"
            )
        lines.append(
            "  native GEMMs whose dims are not multiples of 16 run emulated"
            + (" (emulate=auto)" if recipe.emulate == "auto" else "")
        )
    if not all(gemms.values()):
        lines.append("  emulated = real low-precision values and scales, dequantized, multiplied in fp32 (exact, slower)")
    return "\n".join(lines)
