"""The grouped GEMMs of the `te` backend, through TE's `general_grouped_gemm`, in bf16/fp32 or fp8.

`general_grouped_gemm` over lists of per-expert operands is what `te.GroupedLinear` runs unless its
grouped-tensor path is on (that one needs cuBLASLt >= 13.4 on Hopper, newer than torch 2.11's cu130
wheels): one cuBLAS GEMM per expert, spread over TE's cuBLAS streams. Per expert e with m_e rows (TE's
`m_splits`), x_e `[m_e, in]`, w_e `[out, in]`, dy_e `[m_e, out]`:

    fprop  y_e  = x_e w_e^T (+ b_e)   layout "TN", one output `[T, out]` filled segment by segment
    dgrad  dx_e = dy_e w_e            layout "NN", one output `[T, in]`
    wgrad  dw_e = dy_e^T x_e          layout "NT", E outputs `[out, in]`; with `accumulate` they are added
                                      into (fp32 main_grad: gradient-accumulation fusion, as TE does)

An expert with no rows has no GEMM: TE zeroes its output (kept as it was under `accumulate`), so its weight
grad is exactly zero and a main_grad is untouched (transformer_engine/pytorch/csrc/extensions/gemm.cpp).

fp8 (`Fp8Operands`): TE's `Float8CurrentScalingQuantizer` per expert, split along the rows in one
`tex.split_quantize` call: one scale per expert for each weight and for each token group of x, a, dy and
dh, scale = FP8_MAX / amax without power-of-two rounding, which is moectl's `tensorwise` recipe
(trainer/precision/recipes/tensorwise.py). E4M3 everywhere, or E5M2 grads under `fp8: hybrid`. Rowwise
copies feed fprop and dgrad's grad operand, columnwise copies dgrad's weight and both wgrad operands (TE
picks the copy from the layout). Accumulation: fprop fast, dgrad and wgrad split unless
`fp8_fast_accum_backward` (TE's Float8CurrentScaling defaults, and moectl's).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

# TE's module defaults (module/base.py _2X_ACC_*): split accumulation in the backward GEMMs only.
SPLIT_ACC_FPROP = False
SPLIT_ACC_BACKWARD = True


def split_rows(t_TX: torch.Tensor, m_splits: Sequence[int]) -> list[torch.Tensor]:
    """Per-expert row segments (views) of a contiguous `[T, X]` tensor."""
    return list(torch.split(t_TX, list(m_splits)))


def fprop(te: Any, w: list[Any], x: list[Any], m_splits: list[int], out_features: int, dtype: torch.dtype,
          device: torch.device, bias: Optional[list[torch.Tensor]] = None) -> torch.Tensor:  # fmt: skip
    """y `[T, out]` = x_e w_e^T (+ b_e) per expert, in `dtype`."""
    y_TO = torch.empty(sum(m_splits), out_features, dtype=dtype, device=device)
    te.general_grouped_gemm(
        w, x, [y_TO], [None] * len(w), dtype, layout="TN", m_splits=m_splits, single_output=True,
        bias=bias, use_bias=bias is not None, use_split_accumulator=SPLIT_ACC_FPROP,
    )  # fmt: skip
    return y_TO


def dgrad(te: Any, w: list[Any], dy: list[Any], m_splits: list[int], in_features: int, dtype: torch.dtype,
          device: torch.device, split_accumulator: bool = SPLIT_ACC_BACKWARD) -> torch.Tensor:  # fmt: skip
    """dx `[T, in]` = dy_e w_e per expert, in `dtype`."""
    dx_TI = torch.empty(sum(m_splits), in_features, dtype=dtype, device=device)
    te.general_grouped_gemm(
        w, dy, [dx_TI], [None] * len(w), dtype, layout="NN", m_splits=m_splits, single_output=True, grad=True,
        use_split_accumulator=split_accumulator,
    )  # fmt: skip
    return dx_TI


def wgrad(te: Any, x: list[Any], dy: list[Any], out: list[torch.Tensor], m_splits: list[int], accumulate: bool,
          split_accumulator: bool = SPLIT_ACC_BACKWARD) -> None:  # fmt: skip
    """out[e] `[out, in]` (+)= dy_e^T x_e per expert, in out's dtype (fp32 targets: fp32 products)."""
    for o in out:
        if not o.is_contiguous():  # TE reads the output's pointer and shape only
            raise ValueError("the te backend's weight-grad targets must be contiguous")
    te.general_grouped_gemm(
        x, dy, out, [None] * len(out), out[0].dtype, layout="NT", m_splits=m_splits, grad=True,
        accumulate=accumulate, use_split_accumulator=split_accumulator,
    )  # fmt: skip


class Fp8Operands:
    """Quantizes the operands of the grouped GEMMs per expert (see the module docstring) for one recipe."""

    def __init__(self, te: Any, recipe: Any, device: torch.device) -> None:
        self.te = te
        self.device = device
        dtypes = te.tex.DType
        self.fwd_dtype = dtypes.kFloat8E4M3
        self.grad_dtype = dtypes.kFloat8E5M2 if recipe.grad_fmt == "e5m2" else dtypes.kFloat8E4M3
        self.split_accumulator = not recipe.fast_accum_backward

    def _quantizers(self, n: int, fp8_dtype: Any, columnwise: bool) -> list[Any]:
        # One quantizer per expert, as GroupedLinear keeps: each quantize computes its own amax and scale.
        out = []
        for _ in range(n):
            q = self.te.Float8CurrentScalingQuantizer(fp8_dtype, self.device, rowwise=True, columnwise=columnwise)
            q.internal = True  # plain storages: no autograd wrapper (we are inside our own autograd node)
            out.append(q)
        return out

    def activation(self, x_TX: torch.Tensor, m_splits: list[int], columnwise: bool) -> list[Any]:
        """x (or fc2's input a) per token group, e4m3; the columnwise copy only when a backward follows."""
        quantizers = self._quantizers(len(m_splits), self.fwd_dtype, columnwise)
        return self.te.tex.split_quantize(x_TX.contiguous(), m_splits, quantizers)

    def weight(self, w_EOI: torch.Tensor, columnwise: bool) -> list[Any]:
        """A grouped weight, one scale per expert (rows of `[E * out, in]` split by expert), e4m3."""
        e, o, i = w_EOI.shape
        return self.te.tex.split_quantize(
            w_EOI.contiguous().reshape(e * o, i), [o] * e, self._quantizers(e, self.fwd_dtype, columnwise)
        )  # fmt: skip

    def grad(self, g_TX: torch.Tensor, m_splits: list[int]) -> list[Any]:
        """An output grad per token group, both copies (rowwise: dgrad, columnwise: wgrad)."""
        quantizers = self._quantizers(len(m_splits), self.grad_dtype, True)
        return self.te.tex.split_quantize(g_TX.contiguous(), m_splits, quantizers)

    @staticmethod
    def keep_columnwise(operands: list[Any]) -> None:
        """Drop the rowwise bytes of forward operands that only wgrad reads from here on (TE does the same)."""
        for t in operands:
            t.update_usage(rowwise_usage=False, columnwise_usage=True)
