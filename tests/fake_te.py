"""A pure-torch stand-in for the few Transformer Engine entry points the `te` backend calls, for CPU tests.

It encodes TE 2.20.2's semantics as read from its source (cpp_extensions/gemm.py, csrc/extensions/gemm.cpp,
common/activation/scaled_activation.cu), so the backend's plumbing (splits, layouts, operands, bias, probs,
interleave, main_grad accumulation, fp8 operand roles) is tested on every machine. Whether TE itself does
what this file says is what tests/trainer/moe/backends/test_te_backend_gpu.py checks on a GPU.

    general_grouped_gemm   D_e = op(B_e) @ op(A_e) (row-major; op = transpose for a "T" in layout "AB"),
                           single output split by m_splits, empty experts skipped with their output
                           zeroed unless accumulating, bias added in fprop, `accumulate` adds into D
    tex.scaled_*           probs * act(h) in fp32, one rounding; d scale = sum da * act(h)
    tex.split_quantize     per-split current scaling (FP8_MAX / amax), values kept dequantized in fp32;
                           a dropped copy (update_usage) raises when a GEMM asks for it
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch

from trainer.moe import expert_math
from trainer.moe.backends.te_runtime import TE

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class FakeFloat8:
    """A quantized operand: its dequantized values, per copy (rowwise / columnwise hold the same values)."""

    def __init__(self, values: torch.Tensor, fmt: str, rowwise: bool, columnwise: bool) -> None:
        self.fmt = fmt
        self.rowwise = values if rowwise else None
        self.columnwise = values if columnwise else None
        self.shape = values.shape

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        if rowwise_usage is False:
            self.rowwise = None
        if columnwise_usage is False:
            self.columnwise = None

    def numel(self) -> int:
        return self.shape.numel()


class FakeQuantizer:
    """Float8CurrentScalingQuantizer(fp8_dtype, device, rowwise=, columnwise=)."""

    def __init__(self, fp8_dtype: str, device: Any, *, rowwise: bool = True, columnwise: bool = True) -> None:
        self.dtype, self.rowwise_usage, self.columnwise_usage, self.internal = fp8_dtype, rowwise, columnwise, False

    def quantize(self, x: torch.Tensor) -> FakeFloat8:
        x32 = x.float()
        amax = x32.abs().max() if x32.numel() else torch.tensor(0.0)
        scale = FP8_MAX[self.dtype] / amax if amax > 0 else torch.tensor(1.0)
        values = (x32 * scale).to(TORCH_FP8[self.dtype]).float() / scale
        return FakeFloat8(values, self.dtype, self.rowwise_usage, self.columnwise_usage)


def _value(t: Any, usage: str) -> torch.Tensor:
    if isinstance(t, FakeFloat8):
        v = getattr(t, usage)
        if v is None:
            raise RuntimeError(f"GEMM requested the {usage} copy, but it was dropped")
        return v
    return t.float()


def general_grouped_gemm(  # type: ignore[no-untyped-def]
    A, B, out, quantization_params, out_dtype, layout="TN", m_splits=None, gelu=False, grad=False, accumulate=False,
    bias=None, use_bias=False, use_split_accumulator=False, D_dtype=None, single_output=False,
):  # fmt: skip
    assert len(A) == len(B) == len(quantization_params) and not gelu
    transa, transb = layout[0] == "T", layout[1] == "T"
    fp8 = [isinstance(t, FakeFloat8) for t in (*A, *B)]
    assert all(fp8) or not any(fp8), "fp8 and high-precision operands mixed in one grouped GEMM"
    a_vals = [_value(a, "rowwise" if transa else "columnwise") for a in A]
    b_vals = [_value(b, "columnwise" if transb else "rowwise") for b in B]
    if single_output:
        assert len(out) == 1 and m_splits is not None and out[0].shape[0] == sum(m_splits)
        outs = list(torch.split(out[0], m_splits))
    else:
        assert len(out) == len(A)
        outs = out
    for i, (a, b, o) in enumerate(zip(a_vals, b_vals, outs)):
        if a.numel() == 0 or b.numel() == 0:
            if o.numel() and not accumulate:
                o.zero_()
            continue
        d = (b.t() if transb else b) @ (a.t() if transa else a)
        assert d.shape == o.shape, (layout, tuple(d.shape), tuple(o.shape))
        if use_bias and not grad:
            d = d + bias[i].float()
        if accumulate:
            o.add_(d.to(o.dtype))
        else:
            o.copy_(d.to(o.dtype))
    return out, None, None


def _split_quantize(tensor, split_sections, quantizer_list, disable_bulk_allocation=False):  # type: ignore[no-untyped-def]
    assert len(split_sections) == len(quantizer_list) and sum(split_sections) == tensor.shape[0]
    return [q.quantize(p) for p, q in zip(torch.split(tensor, list(split_sections)), quantizer_list)]


def _act(activation: str):  # type: ignore[no-untyped-def]
    def forward(h, scales, quantizer, interleave=0):  # type: ignore[no-untyped-def]
        assert quantizer is None and scales.numel() == h.shape[0] and h.is_contiguous()
        assert interleave == 0 or interleave % 32 == 0
        return expert_math.fused_forward(h, scales, activation, interleave or None)

    def backward(grad, h, scales, quantizer, interleave=0, compute_scale_grad=True):  # type: ignore[no-untyped-def]
        assert quantizer is None and (not interleave or interleave % 32 == 0)
        dh, dscales, _ = expert_math.fused_backward(h, scales, grad, activation, interleave or None)
        return dh, dscales if compute_scale_grad else None

    return forward, backward


def _clamped(fn, backward: bool):  # type: ignore[no-untyped-def]
    """scaled_clamped_(d)swiglu as the te backend calls it: quick_geglu exactly when nothing is clamped."""

    def call(*args):  # type: ignore[no-untyped-def]
        n = 4 if backward else 3
        limit, alpha, offset = args[n : n + 3]
        assert limit >= 3e38 and abs(alpha - 1.702) < 1e-6 and offset == 0.0
        return fn(*args[:n], *args[n + 3 :])

    return call


def fake_te() -> TE:
    """The stand-in, shaped like `te_runtime.TE`."""
    swiglu, dswiglu = _act("swiglu")
    qgeglu, dqgeglu = _act("quick_geglu")
    srelu, dsrelu = _act("squared_relu")
    tex = SimpleNamespace(
        DType=SimpleNamespace(kFloat8E4M3="e4m3", kFloat8E5M2="e5m2"),
        split_quantize=_split_quantize,
        scaled_swiglu=swiglu,
        scaled_dswiglu=dswiglu,
        scaled_clamped_swiglu=_clamped(qgeglu, backward=False),
        scaled_clamped_dswiglu=_clamped(dqgeglu, backward=True),
        scaled_srelu=lambda h, s, q: srelu(h, s, q, 0),
        scaled_dsrelu=lambda g, h, s, q, c=True: dsrelu(g, h, s, q, 0, c),
    )
    return TE("2.20.2-fake", tex, general_grouped_gemm, FakeQuantizer)
