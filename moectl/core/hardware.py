"""Which low-precision GEMMs run natively on which GPU: the one table, torch-free.

Both sides read it: `trainer/precision/native.py` (what the training run actually dispatches to a kernel)
and rule MOE038 in `moectl/core/rules.py` (what `validate-config` warns about, without importing torch). So the
warning can never disagree with what the run does.

What this build runs natively (everything else is emulated exactly: real low-precision values and scales,
dequantized, multiplied in fp32):

    GEMM family   kernel                       scaling kinds   operand formats        compute capability
    linear        torch._scaled_mm             tensor          any pair but e5m2 x e5m2   sm89 and newer
    linear        torch._scaled_mm (rowwise)   row             e4m3 x e4m3                sm89 and newer
    grouped       torch._scaled_grouped_mm     tensor, row     e4m3 x e4m3                sm90, sm100
    grouped       moectl's Triton fp8 kernels  tensor          e4m3/e5m2, not e5m2 x e5m2 sm90 and newer
                  (trainer/kernels/fp8_*_triton.py: data and weight grads)

Block-scaled recipes (blockwise 128x128/1x128, mxfp8, nvfp4) have no native path in this build on any
device: their kernels (cuBLAS MX/NVFP4 GEMMs, DeepGEMM) are not wired in. Shape limits (dims multiples of
16) are checked per call by native.py; a GEMM whose shapes do not fit runs emulated under `emulate: auto`.

A recipe's three operands (weight, activation, grad) and the pairs its GEMMs multiply:
    fprop (activation x weight), dgrad (grad x weight), wgrad (grad x activation).
Under `fp8: hybrid` the grads are e5m2 (TE's Format.HYBRID), which torch's grouped kernel does not take:
the grouped backward GEMMs of tensorwise and delayed run in moectl's Triton kernels then (an e5m2 x e4m3
tensor-core product, as TE and cuBLAS run it), those of rowwise are emulated.
"""

from __future__ import annotations

from typing import Optional

Capability = tuple[int, int]

SCALED_MM_FROM: Capability = (8, 9)  # torch._scaled_mm: Ada and newer
SCALED_GROUPED_MM_MAJORS = (9, 10)  # torch._scaled_grouped_mm: Hopper and datacenter Blackwell only

# recipe name -> scaling kind of its operands (the `Scheme.kind` of trainer/precision/scheme.py)
RECIPE_KIND = {
    "tensorwise": "tensor",
    "delayed": "tensor",
    "rowwise": "row",
    "blockwise": "block",
    "mxfp8": "mx",
    "nvfp4": "nvfp4",
}
GEMM_OPERANDS = {"fprop": ("activation", "weight"), "dgrad": ("grad", "weight"), "wgrad": ("grad", "activation")}
FAMILIES = ("linear", "grouped")


def has_scaled_mm(capability: Optional[Capability]) -> bool:
    """Whether fp8 `torch._scaled_mm` runs on a GPU of this compute capability (None: not a GPU)."""
    return capability is not None and tuple(capability) >= SCALED_MM_FROM


def has_scaled_grouped_mm(capability: Optional[Capability]) -> bool:
    """Whether fp8 `torch._scaled_grouped_mm` runs on a GPU of this compute capability."""
    return capability is not None and capability[0] in SCALED_GROUPED_MM_MAJORS


def kernel_supports(kind: str, fmt_a: str, fmt_b: str, *, grouped: bool, capability: Optional[Capability]) -> bool:
    """Whether a GEMM of two operands of scaling `kind` and element formats `fmt_a`, `fmt_b` has a native
    kernel at `capability` (the table in the module docstring)."""
    if kind not in ("tensor", "row"):
        return False
    if grouped:
        return has_scaled_grouped_mm(capability) and fmt_a == "e4m3" and fmt_b == "e4m3"
    if not has_scaled_mm(capability):
        return False
    if kind == "tensor":
        return not (fmt_a == "e5m2" and fmt_b == "e5m2")
    return fmt_a == "e4m3" and fmt_b == "e4m3"


#: the tile of moectl's Triton fp8 grouped kernels along the expert widths they take whole (their `fits`):
#: hybrid's expert data and weight grads need model and expert widths in multiples of it
TRITON_GROUPED_TILE = 128


def triton_grouped_supports(kind: str, fmt_a: str, fmt_b: str, capability: Optional[Capability]) -> bool:
    """Whether moectl's Triton fp8 grouped kernels take this pair at `capability` (the table above): per-tensor
    scales, e4m3/e5m2 operands but not both e5m2, TMA (sm90 and newer)."""
    fmts = {"e4m3", "e5m2"}
    return (
        kind == "tensor" and capability is not None and capability[0] >= 9
        and fmt_a in fmts and fmt_b in fmts and not fmt_a == fmt_b == "e5m2"
    )  # fmt: skip


def gemm_native(kind: str, fmt_a: str, fmt_b: str, gemm: str, *, grouped: bool, capability: Optional[Capability],
                torch_kernel: bool = True) -> bool:  # fmt: skip
    """Whether GEMM `gemm` ("fprop", "dgrad", "wgrad") of this operand pair runs natively at `capability`: torch's
    kernel (`kernel_supports`; `torch_kernel`: this torch has it), or, for the experts' backward, moectl's
    Triton kernels (`triton_grouped_supports`: fp8 hybrid's e5m2 grads)."""
    return (torch_kernel and kernel_supports(kind, fmt_a, fmt_b, grouped=grouped, capability=capability)) or (
        grouped and gemm != "fprop" and triton_grouped_supports(kind, fmt_a, fmt_b, capability)
    )


def operand_formats(recipe: str, fp8_format: Optional[str]) -> dict[str, str]:
    """Element format per operand role: e2m1 everywhere for nvfp4, else e4m3 with e5m2 grads under hybrid."""
    if recipe == "nvfp4":
        return {"weight": "e2m1", "activation": "e2m1", "grad": "e2m1"}
    grad = "e5m2" if fp8_format == "hybrid" else "e4m3"
    return {"weight": "e4m3", "activation": "e4m3", "grad": grad}


def native_gemms(recipe: str, fp8_format: Optional[str], capability: Optional[Capability]) -> dict[str, bool]:
    """For each of the six GEMMs ("linear.fprop" ... "grouped.wgrad"): native at `capability`?

    `recipe` is a config name (`RECIPE_KIND`'s keys); an unknown name is reported as emulated everywhere.
    """
    kind = RECIPE_KIND.get(recipe, "")
    fmts = operand_formats(recipe, fp8_format)
    out = {}
    for family in FAMILIES:
        for gemm, (a, b) in GEMM_OPERANDS.items():
            out[f"{family}.{gemm}"] = gemm_native(
                kind, fmts[a], fmts[b], gemm, grouped=family == "grouped", capability=capability
            )
    return out


def emulated_gemms(
    recipe: str, fp8_format: Optional[str], capability: Optional[Capability], families: tuple[str, ...] = FAMILIES
) -> list[str]:
    """The GEMMs of `families` that a run of `recipe` emulates at `capability` (empty: fully native)."""
    gemms = native_gemms(recipe, fp8_format, capability)
    return [k for k, native in gemms.items() if k.split(".")[0] in families and not native]
