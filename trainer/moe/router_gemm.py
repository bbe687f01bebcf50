"""The router's fp32 logits from bf16 tensor-core GEMMs: `x @ W^T` with fp32 W split into three bf16 parts.

The router scores in fp32 (bf16 logits tie and flip top-k choices). As `F.linear(x.float(), W)` its three
GEMMs (forward, data grad, weight grad) run on CUDA cores: fp32 has no tensor-core path without TF32, which
rounds the inputs to 10 bits. On the fine-grained bench config (128 experts) they took ~5 ms of a 189 ms step
on an H100, plus the fp32 copy of x. Here each runs as one bf16 GEMM with fp32 output (`torch.mm(...,
out_dtype=torch.float32)`), exact in its products:

- x is bf16 already (the norm's output), so `x.float()` adds no information;
- W (fp32) = hi + mid + lo, each part bf16 (`split3`: 8 + 8 + 8 significant bits, so the sum is W exactly
  unless a part falls below bf16's normal range), and a bf16 x bf16 product is exact in fp32;
- forward: `[lo; hi; mid]` stacked `[3E, D]`, one GEMM `[T, 3E]`, the three blocks summed smallest first;
- weight grad: the same with the logits' grad split (`[3E, T] @ x`);
- data grad: rounded to x's bf16 anyway, so `g_hi W_hi + g_hi W_mid + g_mid W_hi` (the terms above 2^-16) in
  one GEMM with a bf16 output.
The weight's parts are stored once as `[lo; hi; mid; hi]` (the forward's operand and the data grad's are
both slices of it) and the grad's parts as the two operands the backward reads; on CUDA each split is one
Triton pass (`kernels/split3_triton.py`, the same bits as `split3`; `MOECTL_TRITON_SPLIT3=0` keeps torch).

The GEMMs accumulate in fp32 on the tensor cores, in another order than cuBLAS's SGEMM and less exactly:
against fp64, logits err by 1.1e-6 of the largest where SGEMM's err by 2.3e-7 (H100; bf16 logits: ~4e-3), so
top-k choices differ from the SGEMM path's only between logits that close (tests/trainer/moe/test_router_gemm.py
bounds the error). On CPU, for an fp32 x, or where torch lacks the fp32-output GEMM (`kernels.fp32_out_gemm`),
`router_logits` is `F.linear(x.float(), W)` itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from trainer.kernels import fp32_out_gemm, triton_runs


def split3(w: torch.Tensor) -> torch.Tensor:
    """`[3, *w.shape]` bf16 parts of fp32 `w`: hi = bf16(w), mid = bf16(w - hi), lo = bf16(w - hi - mid)."""
    hi = w.to(torch.bfloat16)
    r = w - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo])


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b` of bf16 operands with fp32 accumulation, returned in `out_dtype` (rounded once)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=out_dtype)
    return (a.float() @ b.float()).to(out_dtype)  # the same exact products, for CPU tests


def weight_parts(w_ED: torch.Tensor) -> torch.Tensor:
    """`[4E, D]` bf16 rows `[lo; hi; mid; hi]` of `split3(w)`: the first 3E rows are the forward's operand,
    the last 3E the data grad's (`[hi; mid; hi]`), so neither needs a `cat` (one Triton pass on CUDA)."""
    if triton_runs(w_ED.device, "MOECTL_TRITON_SPLIT3"):
        from trainer.kernels.split3_triton import split_rows

        return split_rows(w_ED.contiguous())
    hi, mid, lo = split3(w_ED)
    return torch.cat([lo, hi, mid, hi])


def grad_parts(g_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`([g_hi | g_mid | g_lo], [g_hi | g_hi | g_mid])`, each `[T, 3E]` bf16, of the fp32 logits' grad: the
    weight grad's operand (read transposed) and the data grad's (one Triton pass on CUDA)."""
    if triton_runs(g_TE.device, "MOECTL_TRITON_SPLIT3"):
        from trainer.kernels.split3_triton import split_cols

        return split_cols(g_TE.contiguous())
    hi, mid, lo = split3(g_TE)
    return torch.cat([hi, mid, lo], dim=1), torch.cat([hi, hi, mid], dim=1)


class _RouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        E = w_ED.shape[0]
        parts = weight_parts(w_ED.detach())  # [4E, D]: lo, hi, mid, hi
        ctx.save_for_backward(x_TD, parts)
        lo, hi, mid = _mm(x_TD, parts[: 3 * E].t(), torch.float32).split(E, dim=1)
        return hi + (mid + lo)  # the small parts first

    @staticmethod
    def backward(ctx: Any, g_TE: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        x_TD, parts = ctx.saved_tensors
        E = parts.shape[0] // 4
        g_parts, lhs = grad_parts(g_TE.float())  # [T, 3E] each
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _mm(lhs, parts[E:], x_TD.dtype)  # g_hi W_hi + g_hi W_mid + g_mid W_hi
        if ctx.needs_input_grad[1]:
            hi, mid, lo = _mm(g_parts.t(), x_TD, torch.float32).split(E, dim=0)  # [E, D] each
            dw = hi + (mid + lo)
        return dx, dw


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """fp32 `x @ w^T` for the router: the split bf16 GEMMs on CUDA for a bf16 `x` (where torch has bf16 GEMMs
    with fp32 output), else `F.linear` in fp32."""
    if (x_TD.is_cuda and x_TD.dtype == torch.bfloat16 and w_ED.dtype == torch.float32
            and fp32_out_gemm(x_TD.device, "mm")):  # fmt: skip
        return _RouterLogits.apply(x_TD.contiguous(), w_ED)
    return F.linear(x_TD.float(), w_ED.float())
