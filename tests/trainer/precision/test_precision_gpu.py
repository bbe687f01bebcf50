"""On a Hopper GPU: the native fp8 tensorwise/rowwise GEMMs (`torch._scaled_mm`,
`torch._scaled_grouped_mm`) agree with the exact emulation of the same quantized operands.

Both paths quantize identically; they differ only in accumulation order and, for the rowwise and grouped
kernels, a bf16 output, so the tolerance is a bf16-rounding one, far tighter than the fp8 error itself.
"""

from __future__ import annotations

import pytest
import torch

from trainer.precision import RowwiseRecipe, TensorwiseRecipe

pytestmark = pytest.mark.gpu

NATIVE_TOL = 1e-2  # relative L2, native vs emulated (same fp8 operands)
FP8_TOL = 0.06  # relative L2, either vs high precision


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(torch, name)

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, name, counted)
    return calls


def _run(recipe, x, w, dy, offs=None):  # type: ignore[no-untyped-def]
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = recipe.linear(x, w) if offs is None else recipe.grouped_linear(x, w, offs)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("cls", [TensorwiseRecipe, RowwiseRecipe])
def test_native_linear_matches_emulation(cls, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(384, 512, device=dev, dtype=torch.bfloat16) * 0.05
    dy = torch.randn(256, 384, device=dev, dtype=torch.bfloat16)
    native = cls("e4m3", emulate="never")
    native.check_device(dev)
    calls = _spy(monkeypatch, "_scaled_mm")
    got = _run(native, x, w, dy)
    assert len(calls) == 3  # fprop, dgrad, wgrad all native
    ref = _run(cls("e4m3", emulate="always"), x, w, dy)
    hp = (x.float() @ w.float().T, dy.float() @ w.float(), dy.float().T @ x.float())
    for a, b, h in zip(got, ref, hp):
        assert _rel(a, b) < NATIVE_TOL
        assert _rel(a, h) < FP8_TOL


@pytest.mark.parametrize("cls", [TensorwiseRecipe, RowwiseRecipe])
def test_native_grouped_linear_matches_emulation(cls, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    dev = torch.device("cuda")
    torch.manual_seed(1)
    counts = [256, 0, 128, 384]  # multiples of align_size (16); one empty expert
    offs = torch.tensor(counts, device=dev).cumsum(0)
    T, D, O = sum(counts), 512, 256
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    w = torch.randn(len(counts), O, D, device=dev, dtype=torch.bfloat16) * 0.05
    dy = torch.randn(T, O, device=dev, dtype=torch.bfloat16)
    native = cls("e4m3", emulate="never")
    native.check_device(dev)
    calls = _spy(monkeypatch, "_scaled_grouped_mm")
    from trainer.kernels import fp8_grouped_mm_triton as kernel

    triton_calls: list[int] = []
    real = kernel.fp8_grouped_mm
    monkeypatch.setattr(kernel, "fp8_grouped_mm", lambda *a, **k: triton_calls.append(1) or real(*a, **k))
    got = _run(native, x, w, dy, offs)
    # tensorwise: the precise data grad (N 512, K 256) runs in moectl's Triton kernel; rowwise: all in torch
    assert (len(calls), len(triton_calls)) == ((2, 1) if cls is TensorwiseRecipe else (3, 0))
    ref = _run(cls("e4m3", emulate="always"), x, w, dy, offs)
    for a, b in zip(got, ref):
        assert _rel(a, b) < NATIVE_TOL
    xs, dys = x.float().split(counts), dy.float().split(counts)
    y_hp = torch.cat([xs[e] @ w[e].float().T for e in range(len(counts))])
    assert _rel(got[0], y_hp) < FP8_TOL
    assert torch.count_nonzero(got[2][1]) == 0


def test_describe_says_native_on_hopper() -> None:
    text = TensorwiseRecipe().describe("cuda")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the native-set assertions are for sm90")
    assert "linear GEMMs: fprop native, dgrad native, wgrad native via torch._scaled_mm" in text
    assert "grouped GEMMs: fprop native, dgrad native, wgrad native via torch._scaled_grouped_mm" in text
