"""Native low-precision GEMMs: `torch._scaled_mm` and `torch._scaled_grouped_mm` on CUDA.

What torch 2.13 offers and what we use (Hopper, sm90; checked against torch/_meta_registrations.py and
torchao/prototype/moe_training/fp8_grouped_mm.py):
- `torch._scaled_mm(a [M,K] row-major, b [K,N] column-major, scale_a, scale_b, out_dtype, use_fast_accum)`
  computes (a * scale_a) @ (b * scale_b) with fp32 accumulation. Tensorwise: both scales are 1-element
  fp32 (any e4m3/e5m2 pair but e5m2 x e5m2; fp32 output allowed). Rowwise: scale_a `[M, 1]`,
  scale_b `[1, N]` fp32, e4m3 operands, bf16 output. K and N must be multiples of 16. Needs sm89+.
- `torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=bf16)`: e4m3 operands only, fp32
  per-row scales, bf16 output, `offs` int32 cumulative group ends; sm90 (and sm100).
  2d x 3d (forward, data grad): a `[T, K]` row-major with scale_a `[T]`, b `[E, K, N]` column-major
  with scale_b `[E, N]`; groups along T. 2d x 2d (weight grad): a `[M, T]` row-major, b `[T, N]`
  column-major, groups along the contraction dim T, scale_a `[G * M]` and scale_b `[G * N]` laid out
  group-major; the result is `[G, M, N]`.
Per-tensor scales are passed to the rowwise kernels expanded to rows (every row of a group gets its
group's scale), which computes exactly the per-tensor product.

Accumulation (`use_fast_accum`): fprop always accumulates fast (Hopper's fp8 tensor-core accumulator,
not promoted to fp32 every few k-steps), as TE and torchao do. dgrad and wgrad accumulate precisely
(split accumulation, TE's choice for the backward GEMMs) unless the recipe asks for fast accumulation there
too (`mixed_precision.fp8_fast_accum_backward`, torchao's fp8 MoE training choice): about 1.6x faster
backward GEMMs on Hopper, at some backward precision.

Weight grads of the grouped kernel come back as its bf16 output (the bf16 fused backend's weight grads are
bf16 too): converting 600M elements to fp32 would cost more than the GEMM saves. Experts with no tokens get
an exact zero grad from a kernel that touches only their slabs (no host sync).

MXFP8 / NVFP4 GEMMs need Blackwell (sm100) kernels and DeepSeek-style blockwise scaled_mm a cuBLAS/torch
combination, none of which this build wires in: those recipes are emulated on every device (see
`report.describe`). Which capability runs what is the torch-free table in `moectl/core/hardware.py`, shared
with rule MOE038 so `validate-config` says exactly what the run will do.

Everything CUDA-only is behind `torch.cuda.is_available()`; this module imports and answers "no" on CPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from moectl.core import hardware
from trainer.kernels import capability, has_triton

from .quantized_tensor import QuantizedTensor


def kernel_supports(kind: str, fmt_a: str, fmt_b: str, *, grouped: bool, device: torch.device | str | None) -> bool:
    """Which operand pairs have a native fp8 kernel on `device`: the table of `moectl.core.hardware` (which
    rule MOE038 reads too), at this device's capability, provided this torch has the kernel."""
    kernel = "_scaled_grouped_mm" if grouped else "_scaled_mm"
    return hasattr(torch, kernel) and hardware.kernel_supports(
        kind, fmt_a, fmt_b, grouped=grouped, capability=capability(device)
    )


def gemm_native(kind: str, fmt_a: str, fmt_b: str, gemm: str, *, grouped: bool,
                device: torch.device | str | None) -> bool:  # fmt: skip
    """`hardware.gemm_native` on `device`: torch's kernel (where this torch has it) or moectl's Triton kernels
    for the experts' backward, the one table rule MOE038 reads too."""
    kernel = "_scaled_grouped_mm" if grouped else "_scaled_mm"
    return hardware.gemm_native(kind, fmt_a, fmt_b, gemm, grouped=grouped, capability=capability(device),
                                torch_kernel=hasattr(torch, kernel))  # fmt: skip


def _pair_ok(a: QuantizedTensor, b: QuantizedTensor, grouped: bool) -> bool:
    return a.scheme.kind == b.scheme.kind and kernel_supports(
        a.scheme.kind, a.scheme.fmt, b.scheme.fmt, grouped=grouped, device=a.device
    )


def mm_supported(a: QuantizedTensor, a_copy: str, b: QuantizedTensor, b_copy: str) -> bool:
    """Whether `_scaled_mm` can run a[a_copy] @ b[b_copy]^T (kinds, formats, device, K and N % 16)."""
    if a.groups is not None or b.groups is not None or len(a.shape) != 2 or len(b.shape) != 2:
        return False
    if not _pair_ok(a, b, grouped=False):
        return False
    K, N = a.copy_shape(a_copy)[-1], b.copy_shape(b_copy)[-2]
    return K % 16 == 0 and N % 16 == 0


def mm(a: QuantizedTensor, a_copy: str, b: QuantizedTensor, b_copy: str, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """a[a_copy] `[M, K]` @ b[b_copy] `[N, K]`^T with `torch._scaled_mm` (check `mm_supported` first)."""
    qa, qb = a.copy(a_copy), b.copy(b_copy)
    mat_b = qb.data.t()  # stored [N, K] row-major -> [K, N] column-major, as the kernel wants
    if a.scheme.kind == "tensor":
        sa, sb, dtype = qa.scale.reshape(1), qb.scale.reshape(1), out_dtype
    else:  # row: [M, 1] and [1, N]; the rowwise kernel writes bf16
        sa, sb, dtype = qa.scale.reshape(-1, 1), qb.scale.reshape(1, -1), torch.bfloat16
    out = torch._scaled_mm(qa.data, mat_b, sa, sb, out_dtype=dtype, use_fast_accum=fast_accum)
    return out.to(out_dtype)


def _row_scales(q: QuantizedTensor, which: str) -> torch.Tensor:
    """Per-row decode scales of a 2-D copy `[R, K]` whose rows may be token rows (jagged)."""
    qd = q.copy(which)
    if q.scheme.kind == "row":
        return qd.scale.reshape(-1)
    jag = q.jagged(which)
    rows = q.copy_shape(which)[-2]
    if jag is not None and qd.gemm_scale is not None:  # expanded by the quantize kernels already
        return qd.gemm_scale
    if jag is None:
        return qd.scale.reshape(1).expand(rows).contiguous()
    return qd.scale.index_select(0, q.groups.ids)  # type: ignore[union-attr]  # (not x[ids]: 4x the host time)


def _expert_row_scales(q: QuantizedTensor, which: str) -> torch.Tensor:
    """Per-(expert, row) decode scales `[E, R]` of a grouped weight copy `[E, R, K]`."""
    qd = q.copy(which)
    E, R = q.copy_shape(which)[0], q.copy_shape(which)[1]
    if q.scheme.kind == "row":
        return qd.scale.reshape(E, R)
    return qd.scale.reshape(E, 1).expand(E, R).contiguous()


def _group_col_scales(q: QuantizedTensor) -> torch.Tensor:
    """Group-major per-(group, row) scales `[G * R]` of a jagged columnwise copy `[R, T]`."""
    qd = q.copy("columnwise")
    R = q.copy_shape("columnwise")[0]
    assert q.groups is not None
    if q.scheme.kind == "row":
        return qd.scale.t().contiguous().reshape(-1)  # [R, G] -> [G, R]
    if qd.gemm_scale is not None:  # expanded by the quantize kernels already
        return qd.gemm_scale
    # [G] -> [G * R] as one copy (repeat_interleave builds a repeats tensor first: several launches)
    return qd.scale.reshape(-1, 1).expand(-1, R).reshape(-1)


def grouped_supported(a: QuantizedTensor, a_copy: str, b: QuantizedTensor, b_copy: str) -> bool:
    """Whether `_scaled_grouped_mm` can run a[a_copy] times b[b_copy]: e4m3 tensor/row kinds on
    sm90/sm100 with the non-token dims multiples of 16. Token groups must be multiples of 16 too; that is
    the dispatcher's contract (`Recipe.align_size`), not checked here because it would cost a host sync."""
    if not _pair_ok(a, b, grouped=True):
        return False
    if a_copy == b_copy == "columnwise":  # weight grad: [O, T] x [D, T]
        dims = [a.copy_shape(a_copy)[0], b.copy_shape(b_copy)[0]]
    else:  # [T, K] x [E, N, K]
        dims = [a.copy_shape(a_copy)[-1], b.copy_shape(b_copy)[-2]]
    return all(d % 16 == 0 for d in dims)


def grouped_mm_2d3d(
    a: QuantizedTensor, a_copy: str, b: QuantizedTensor, b_copy: str, out_dtype: torch.dtype, fast_accum: bool
) -> torch.Tensor:
    """Jagged a[a_copy] `[T, K]` times expert b[b_copy] `[E, N, K]`^T -> `[T, N]` (forward, data grad)."""
    assert a.groups is not None
    qa, qb = a.copy(a_copy), b.copy(b_copy)
    out = torch._scaled_grouped_mm(
        qa.data,
        qb.data.transpose(-2, -1),  # [E, N, K] row-major -> [E, K, N] column-major
        _row_scales(a, a_copy),
        _expert_row_scales(b, b_copy),
        offs=a.groups.offsets_i32,
        out_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )
    return out.to(out_dtype)


def grouped_mm_2d2d(g: QuantizedTensor, x: QuantizedTensor, fast_accum: bool = False) -> torch.Tensor:
    """Weight grad: g columnwise `[O, T]` times x columnwise `[D, T]`^T per token group -> `[E, O, D]` bf16
    (the kernel's output, not converted: see the module docstring)."""
    assert g.groups is not None
    qg, qx = g.copy("columnwise"), x.copy("columnwise")
    out = torch._scaled_grouped_mm(
        qg.data,
        qx.data.t(),  # [D, T] row-major -> [T, D] column-major
        _group_col_scales(g),
        _group_col_scales(x),
        offs=g.groups.offsets_i32,
        out_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )
    # An expert with no tokens contracts over nothing: make its grad exactly zero whatever the kernel
    # leaves there (what `_scaled_grouped_mm` writes for an empty group is not documented).
    return zero_empty_groups_(out, g.groups.offsets)


def triton_grouped_supported(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    """Whether moectl's Triton fp8 grouped kernels take this operand pair on its device (`hardware`'s table:
    per-tensor e4m3/e5m2 pairs, not both e5m2, sm90 and newer); shapes are checked by the kernels' `fits`."""
    return a.device.type == "cuda" and has_triton() and hardware.triton_grouped_supports(
        a.scheme.kind, a.scheme.fmt, b.scheme.fmt, capability(a.device)
    )


def grouped_dgrad_triton(g: QuantizedTensor, w: QuantizedTensor, fast_accum: bool) -> Optional[torch.Tensor]:
    """The grouped data grad (g rowwise `[T, O]` times w's columnwise copy `[E, D, O]`) by
    `trainer/kernels/fp8_grouped_mm_triton.py` where it is the kernel to use, else None: pairs torch's
    grouped kernel does not take (`fp8: hybrid`'s e5m2 grads), and precise accumulation at the shapes where it
    was measured faster than torch's precise kernel (`preferred`: 2.2-2.9x where torch's ran the experts' data
    grads at 200-300 TFLOP/s, docs/benchmarks.md, twelfth session)."""
    if g.groups is None or not triton_grouped_supported(g, w):
        return None
    from trainer.kernels import fp8_grouped_mm_triton as kernel  # lazy: needs Triton

    qg, qw = g.copy("rowwise"), w.copy("columnwise")
    torch_takes = grouped_supported(g, "rowwise", w, "columnwise")
    N, K = qw.data.shape[1], qw.data.shape[2]
    if (torch_takes and (fast_accum or not kernel.preferred(N, K))) or not kernel.fits(qg.data, qw.data):
        return None
    sg, sw = _one_scale_each(qg.scale, g.groups.count), _one_scale_each(qw.scale, qw.data.shape[0])
    return kernel.fp8_grouped_mm(qg.data, qw.data, g.groups.offsets, sg, sw, fast_accum=fast_accum)


def grouped_wgrad_triton(g: QuantizedTensor, x: QuantizedTensor, fast_accum: bool) -> Optional[torch.Tensor]:
    """The grouped weight grad `[E, O, D]` in fp32 by the Triton wgrad kernel (summed into zeros) for the pairs
    torch's grouped kernel does not take (`fp8: hybrid`), else None (torch's kernel, or emulation)."""
    if g.groups is None or grouped_supported(g, "columnwise", x, "columnwise") or not triton_grouped_supported(g, x):
        return None
    E, O, D = g.groups.count, g.shape[-1], x.shape[-1]
    out = torch.zeros(E, O, D, dtype=torch.float32, device=g.device)
    # expert e's rows of the [E * O, D] matrix start at e * O: made on the device, not looked up by address
    # (a fresh tensor each call; the address-keyed layout copies its table from the host, a sync a CUDA
    # graph cannot hold)
    first_rows = torch.arange(E, device=g.device, dtype=torch.int64) * O
    return out if _fp8_wgrad(g, x, (out.view(E * O, D), first_rows), fast_accum) else None


def grouped_wgrad_accumulate_(g: QuantizedTensor, x: QuantizedTensor, targets: list[torch.Tensor],
                              fast_accum: bool = False) -> bool:
    """targets[e] += dW[e], the weight grad `grouped_mm_2d2d` would return, summed in fp32 and added into the
    fp32 `[O, D]` targets in one Triton kernel (`trainer/kernels/fp8_wgrad_triton.py`): gradient-accumulation
    fusion, no bf16 grad written, read and added. Whether it ran: it takes per-tensor e4m3/e5m2 copies (one
    scale per token group; `triton_grouped_supported`) on Hopper or later, targets that are whole rows of one
    allocation, and 128-row tiles of each grad; elsewhere the caller computes dW and adds it."""
    if g.groups is None or not triton_grouped_supported(g, x):
        return False
    from trainer.kernels.grouped_wgrad import rows_view

    rows = rows_view(targets)
    return rows is not None and _fp8_wgrad(g, x, rows, fast_accum)


def _fp8_wgrad(g: QuantizedTensor, x: QuantizedTensor, rows: tuple[torch.Tensor, torch.Tensor], fast_accum: bool) -> bool:
    """The Triton fp8 wgrad into `rows` (an fp32 `[R, D]` matrix, each expert's first row), if it fits."""
    from trainer.kernels import fp8_wgrad_triton as kernel  # lazy: needs Triton

    assert g.groups is not None
    qg, qx = g.copy("columnwise"), x.copy("columnwise")
    if not kernel.fits(qg.data, qx.data, qg.data.shape[0]):
        return False
    sg, sx = _one_scale_each(qg.scale, g.groups.count), _one_scale_each(qx.scale, g.groups.count)
    kernel.fp8_grouped_wgrad_accumulate_tma_(*rows, qg.data, qx.data, g.groups.offsets, sg, sx, fast_accum=fast_accum)
    return True


def _one_scale_each(scale: torch.Tensor, n: int) -> torch.Tensor:
    """A per-tensor decode scale as the Triton kernels take it: fp32 `[n]`, one per token group or expert
    (a single scale repeated; per-group or per-expert scales as they are)."""
    flat = scale.reshape(-1).float()
    return flat if flat.numel() == n else flat.expand(n).contiguous()


def zero_empty_groups_(out_GXY: torch.Tensor, offsets_G: torch.Tensor) -> torch.Tensor:
    """Zero `out[g]` in place for every group g without rows (offsets: cumulative ends, on the device; no
    host sync): a Triton kernel touching only those slabs on CUDA, a masked fill (one full pass) elsewhere."""
    if out_GXY.is_cuda and out_GXY.is_contiguous() and has_triton():
        from trainer.kernels.fp8_quant_triton import zero_empty_groups_ as kernel  # lazy: needs Triton

        return kernel(out_GXY, offsets_G)
    counts = torch.diff(offsets_G, prepend=offsets_G.new_zeros(1))
    empty = (counts == 0).view(-1, *([1] * (out_GXY.dim() - 1)))
    return out_GXY.masked_fill_(empty, 0)
