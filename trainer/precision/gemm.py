"""The six GEMMs of a (grouped) linear layer over quantized operands, native or emulated.

For y = x W^T with x `[T, D]`, W `[O, D]` (TE's naming; every operand contracts along its last dim):

    fprop  y  [T, O] = x.rowwise    @ W.rowwise^T        (contract D)
    dgrad  dx [T, D] = dy.rowwise   @ W.columnwise^T     (contract O; W.columnwise is W^T quantized along O)
    wgrad  dW [O, D] = dy.columnwise @ x.columnwise^T    (contract T; both quantized along tokens)

Grouped: x and dy are jagged `[T, .]` with token groups, W is `[E, O, D]`; expert e's rows use W[e], and
dW[e] contracts over expert e's tokens only.

Emulation (the exact reference, and the path wherever no native kernel exists): dequantize the real
low-precision values and scales to fp32 and multiply in fp32. Outputs are cast to `out_dtype`; weight
grads stay fp32 (they go to fp32 main_grad), except the native grouped wgrad, which returns its kernel's
bf16 output (native.py says why). Native: `native.py`.

`fast_accum` (dgrad, wgrad; the recipe's `fast_accum_backward`): fast accumulation in the native backward
GEMMs, as fprop always has. Emulated GEMMs accumulate in fp32 either way.

`mode`: "auto" runs natively where `native.py` supports the operand pair (else emulates), "emulate"
always emulates, "native" raises where no native kernel fits (the config's `emulate: never`).
"""

from __future__ import annotations

from typing import Literal

import torch

from . import native as nat
from .quantized_tensor import QuantizedTensor

Mode = Literal["auto", "emulate", "native"]


def _use_native(supported: bool, mode: Mode, what: str) -> bool:
    if mode == "emulate":
        return False
    if mode == "native" and not supported:
        raise RuntimeError(
            f"{what}: no native kernel for these operands on this device and mixed_precision.emulate is "
            "'never'; set emulate: auto (or always) to run it emulated"
        )
    return supported


def _mm_emulated(a: QuantizedTensor, a_copy: str, b: QuantizedTensor, b_copy: str) -> torch.Tensor:
    return a.dequantize_copy(a_copy) @ b.dequantize_copy(b_copy).transpose(-2, -1)


def _mm(
    a: QuantizedTensor, a_copy: str, b: QuantizedTensor, b_copy: str, out_dtype: torch.dtype, mode: Mode, what: str,
    fast_accum: bool,
) -> torch.Tensor:  # fmt: skip
    if _use_native(nat.mm_supported(a, a_copy, b, b_copy), mode, what):
        return nat.mm(a, a_copy, b, b_copy, out_dtype, fast_accum=fast_accum)
    return _mm_emulated(a, a_copy, b, b_copy).to(out_dtype)


def fprop(xq: QuantizedTensor, wq: QuantizedTensor, *, out_dtype: torch.dtype, mode: Mode = "auto") -> torch.Tensor:
    """y `[T, O]` = x `[T, D]` @ W `[O, D]`^T."""
    return _mm(xq, "rowwise", wq, "rowwise", out_dtype, mode, "fprop", True)


def dgrad(
    gq: QuantizedTensor, wq: QuantizedTensor, *, out_dtype: torch.dtype, mode: Mode = "auto", fast_accum: bool = False
) -> torch.Tensor:
    """dx `[T, D]` = dy `[T, O]` @ W `[O, D]` (W's columnwise copy)."""
    return _mm(gq, "rowwise", wq, "columnwise", out_dtype, mode, "dgrad", fast_accum)


def wgrad(gq: QuantizedTensor, xq: QuantizedTensor, *, mode: Mode = "auto", fast_accum: bool = False) -> torch.Tensor:
    """dW `[O, D]` = dy^T @ x (columnwise copies of both), fp32."""
    return _mm(gq, "columnwise", xq, "columnwise", torch.float32, mode, "wgrad", fast_accum)


def _segments(q: QuantizedTensor) -> list[tuple[int, int]]:
    if q.groups is None:
        raise ValueError("grouped GEMMs need a token-grouped activation (quantize it with offsets)")
    if q.groups.uniform is not None:  # drop-and-pad: static segments, no device read (CUDA graphs)
        u = q.groups.uniform
        return [(g * u, (g + 1) * u) for g in range(q.groups.count)]
    ends = q.groups.offsets.tolist()
    return list(zip([0] + ends[:-1], ends))


def grouped_fprop(xq: QuantizedTensor, wq: QuantizedTensor, *, out_dtype: torch.dtype, mode: Mode = "auto") -> torch.Tensor:
    """y `[T, O]`: rows of group e times W[e]^T, W `[E, O, D]`."""
    if _use_native(nat.grouped_supported(xq, "rowwise", wq, "rowwise"), mode, "grouped fprop"):
        return nat.grouped_mm_2d3d(xq, "rowwise", wq, "rowwise", out_dtype, fast_accum=True)
    return _grouped_2d3d_emulated(xq, wq, "rowwise").to(out_dtype)


def grouped_dgrad(
    gq: QuantizedTensor, wq: QuantizedTensor, *, out_dtype: torch.dtype, mode: Mode = "auto", fast_accum: bool = False
) -> torch.Tensor:
    """dx `[T, D]`: rows of group e times W[e] (W's columnwise copy `[E, D, O]`); moectl's Triton kernel where
    it is the one to use (`native.grouped_dgrad_triton`), else torch's."""
    if mode != "emulate":
        out = nat.grouped_dgrad_triton(gq, wq, fast_accum)
        if out is not None:
            return out.to(out_dtype)
    if _use_native(nat.grouped_supported(gq, "rowwise", wq, "columnwise"), mode, "grouped dgrad"):
        return nat.grouped_mm_2d3d(gq, "rowwise", wq, "columnwise", out_dtype, fast_accum=fast_accum)
    return _grouped_2d3d_emulated(gq, wq, "columnwise").to(out_dtype)


def grouped_wgrad(gq: QuantizedTensor, xq: QuantizedTensor, *, mode: Mode = "auto", fast_accum: bool = False) -> torch.Tensor:
    """dW `[E, O, D]`: per group, dy_e^T @ x_e (columnwise copies, contracting over the group's tokens); fp32
    emulated and from moectl's Triton kernel (`fp8: hybrid`), torch's kernel's bf16 natively."""
    if mode != "emulate":
        out = nat.grouped_wgrad_triton(gq, xq, fast_accum)
        if out is not None:
            return out
    if _use_native(nat.grouped_supported(gq, "columnwise", xq, "columnwise"), mode, "grouped wgrad"):
        return nat.grouped_mm_2d2d(gq, xq, fast_accum=fast_accum)
    g = gq.dequantize_copy("columnwise")  # [O, T]
    x = xq.dequantize_copy("columnwise")  # [D, T]
    # contiguous slices: the same memory layout as a per-expert GEMM, so the results match it bitwise
    parts = [g[:, s:e].contiguous() @ x[:, s:e].contiguous().t() for s, e in _segments(gq)]
    return torch.stack(parts)


def _grouped_2d3d_emulated(aq: QuantizedTensor, wq: QuantizedTensor, w_copy: str) -> torch.Tensor:
    a = aq.dequantize_copy("rowwise")  # [T, K]
    w = wq.dequantize_copy(w_copy)  # [E, N, K]
    if w.shape[0] != (aq.groups.count if aq.groups is not None else -1):
        raise ValueError(f"{w.shape[0]} experts in the weight but {aq.groups.count if aq.groups else 0} token groups")
    parts = [a[s:e] @ w[i].t() for i, (s, e) in enumerate(_segments(aq))]
    return torch.cat(parts) if parts else a.new_zeros(0, w.shape[1])
