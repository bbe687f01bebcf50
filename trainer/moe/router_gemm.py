"""The router's fp32 logits from bf16 tensor-core GEMMs: `x @ W^T` with fp32 W split into three bf16 parts.

The router scores in fp32 (bf16 logits tie and flip top-k choices). As `F.linear(x.float(), W)` its three
GEMMs (forward, data grad, weight grad) run on CUDA cores: fp32 has no tensor-core path without TF32, which
rounds the inputs to 10 bits. On the fine-grained bench config (128 experts) they took ~5 ms of a 189 ms step
on an H100, plus the fp32 copy of x. Here each runs as one bf16 GEMM with fp32 output (`torch.mm(...,
out_dtype=torch.float32)`), exact in its products:

- x is bf16 already (the norm's output), so `x.float()` adds no information;
- W (fp32) = hi + mid + lo, each part bf16 (`split3`: 8 + 8 + 8 significant bits, so the sum is W exactly
  unless a part falls below bf16's normal range), and a bf16 x bf16 product is exact in fp32;
- forward: `[hi; mid; lo]` stacked `[3E, D]`, one GEMM `[T, 3E]`, the three blocks summed smallest first;
- weight grad: the same with the logits' grad split (`[3E, T] @ x`);
- data grad: rounded to x's bf16 anyway, so `g_hi W_hi + g_hi W_mid + g_mid W_hi` (the terms above 2^-16) in
  one GEMM with a bf16 output.

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

from trainer.kernels import fp32_out_gemm


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


def _sum3(y: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """The three `n`-wide blocks of `y` along `dim` summed as hi + (mid + lo): the small parts first."""
    hi, mid, lo = y.split(n, dim=dim)
    return hi + (mid + lo)


class _RouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        E = w_ED.shape[0]
        parts = split3(w_ED.detach())  # [3, E, D]
        ctx.save_for_backward(x_TD, parts)
        return _sum3(_mm(x_TD, parts.reshape(3 * E, -1).t(), torch.float32), E, dim=1)

    @staticmethod
    def backward(ctx: Any, g_TE: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        x_TD, parts = ctx.saved_tensors
        E = parts.shape[1]
        g = split3(g_TE.float())  # [3, T, E]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            lhs = torch.cat([g[0], g[0], g[1]], dim=1)  # [T, 3E]: g_hi W_hi + g_hi W_mid + g_mid W_hi
            rhs = torch.cat([parts[0], parts[1], parts[0]], dim=0)  # [3E, D]
            dx = _mm(lhs, rhs, x_TD.dtype)
        if ctx.needs_input_grad[1]:
            dw = _sum3(_mm(g.transpose(1, 2).reshape(3 * E, -1), x_TD, torch.float32), E, dim=0)  # [E, D]
        return dx, dw


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """fp32 `x @ w^T` for the router: the split bf16 GEMMs on CUDA for a bf16 `x` (where torch has bf16 GEMMs
    with fp32 output), else `F.linear` in fp32."""
    if (x_TD.is_cuda and x_TD.dtype == torch.bfloat16 and w_ED.dtype == torch.float32
            and fp32_out_gemm(x_TD.device, "mm")):  # fmt: skip
        return _RouterLogits.apply(x_TD.contiguous(), w_ED)
    return F.linear(x_TD.float(), w_ED.float())
