"""The router's logits from split bf16 GEMMs (trainer/moe/router_gemm.py) against fp64 and `F.linear` in fp32.

The split path is exact in its products (bf16 x bf16 in fp32) and W = hi + mid + lo exactly, so its logits and
weight grads are as close to fp64 as `F.linear(x.float(), W)`'s up to the accumulation: on CPU within 2x its
error (2.3e-7 vs 4.9e-7; with the `lo` part dropped 2.8e-6, caught), on CUDA within 8x or 2e-6 of the
largest value, whichever is larger (H100, the tensor cores' accumulation: logits 1.1e-6 vs SGEMM's 2.3e-7;
bf16 logits would err by ~4e-3). The data grad is rounded to bf16 as
the fp32 path's cast does: within one bf16 ulp (2^-8 relative) of the fp64 grad. A lost part (hi only: 2^-9)
or a swapped operand is 1000x over. CPU: the Function with its CPU GEMMs (the same products). GPU: the
cuBLAS GEMMs with fp32 output that the CUDA path runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.moe.router_gemm import _RouterLogits, grad_parts, router_logits, split3, weight_parts


def test_split3_is_exact() -> None:
    w = torch.randn(64, 512) * torch.logspace(-6, 2, 512)
    parts = split3(w)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, 64, 512)
    assert torch.equal(parts.float().sum(0), w)


def _check(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    T, D, E = 1024, 512, 32
    x = torch.randn(T, D, generator=gen).bfloat16().to(device).requires_grad_()
    w = (torch.randn(E, D, generator=gen) * 0.02).to(device).requires_grad_()
    g = torch.randn(T, E, generator=gen).to(device)
    y = _RouterLogits.apply(x, w)
    y.backward(g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 @ w64.t()
    y64.backward(g.double())
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr = F.linear(xr.float(), wr)
    yr.backward(g)

    def err(a: torch.Tensor, ref: torch.Tensor) -> float:
        return float((a.detach().double() - ref.detach()).abs().max() / ref.detach().abs().max())

    assert y.dtype == torch.float32 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    for ours, fp32, ref in ((y, yr, y64), (w.grad, wr.grad, w64.grad)):
        # CPU: exact products, fp32 sums on both sides; CUDA: the tensor cores' accumulation (see the docstring)
        bound = 2 * err(fp32, ref) if device == "cpu" else max(8 * err(fp32, ref), 2e-6)
        assert err(ours, ref) <= bound, (err(ours, ref), err(fp32, ref))
    assert err(x.grad, x64.grad) <= 2**-8
    assert float((x.grad.float() != xr.grad.float()).float().mean()) < 0.05  # rounds like the fp32 path's cast


def test_split_gemms_match_fp32_accuracy_on_cpu() -> None:
    _check("cpu")


def test_router_logits_is_f_linear_off_cuda() -> None:
    x, w = torch.randn(8, 16).bfloat16(), torch.randn(4, 16)
    assert torch.equal(router_logits(x, w), F.linear(x.float(), w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device tool)")
def test_split_gemms_match_fp32_accuracy_on_cuda() -> None:
    _check("cuda")
    x = torch.randn(8, 16, device="cuda").bfloat16()
    assert router_logits(x, torch.randn(4, 16, device="cuda")).dtype == torch.float32


def test_parts_are_split3_in_the_operand_layouts() -> None:
    """The CPU path of the stored operands: `[lo; hi; mid; hi]` rows and the grad's two `[T, 3E]` operands."""
    w = torch.randn(4, 16) * torch.logspace(-6, 2, 16)
    hi, mid, lo = split3(w)
    assert torch.equal(weight_parts(w), torch.cat([lo, hi, mid, hi]))
    g = torch.randn(8, 4)
    hi, mid, lo = split3(g)
    parts, lhs = grad_parts(g)
    assert torch.equal(parts, torch.cat([hi, mid, lo], 1)) and torch.equal(lhs, torch.cat([hi, hi, mid], 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device tool)")
@pytest.mark.parametrize("E,D,T", [(32, 2048, 8192), (128, 2048, 4096), (7, 33, 100)])
def test_triton_split_is_split3_bitwise(E: int, D: int, T: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the splits run one Triton pass each (kernels/split3_triton.py, round to nearest even as torch's
    casts); their bits equal the torch path's (`MOECTL_TRITON_SPLIT3=0`), and so do the router's logits and
    grads. Values span 2^-27..2^10, so each part rounds somewhere."""
    from trainer.kernels import has_triton

    if not has_triton():
        pytest.skip("needs Triton")
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(E, D, generator=gen) * torch.logspace(-8, 3, D)).cuda()
    g = (torch.randn(T, E, generator=gen) * 1e-3).cuda()
    x = torch.randn(T, D, generator=gen).bfloat16().cuda()
    out = {}
    for fast in ("1", "0"):
        monkeypatch.setenv("MOECTL_TRITON_SPLIT3", fast)
        xr, wr = x.clone().requires_grad_(), (w * 1e-3).requires_grad_()
        y = _RouterLogits.apply(xr, wr)
        y.backward(g)
        out[fast] = (weight_parts(w), *grad_parts(g), y, xr.grad, wr.grad)
    for a, b in zip(out["1"], out["0"]):
        assert torch.equal(a, b)
