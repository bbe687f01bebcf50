"""The one-pass MXFP8 quantizer (trainer/kernels/mxfp8_quant_triton.py) against the eager MX kind.

GPU tests (marked `gpu`): `quantize` on CUDA takes the Triton kernel for the mx kind and gives exactly the
eager QuantizedTensor (kinds/mx.py, run with `MOECTL_TRITON_QUANTIZE=0` on the same device): the same data
bytes of both copies and the same E8M0 scale bytes, for bf16 and fp32 inputs, e4m3 and e5m2, `floor` and
`rceil` scale rounding, a grouped weight `[E, M, K]` with ragged last blocks, a token-grouped activation, and
NaN / inf / all-zero / tiny / huge blocks. CPU: the kernel is not selected off CUDA or for other kinds.
"""

from __future__ import annotations

import pytest
import torch

from trainer.precision import QuantizedTensor, Scheme, quantize
from trainer.precision.groups import TokenGroups
from trainer.precision.quantize import mx_triton_fast_path

gpu = pytest.mark.gpu
OFF = "MOECTL_TRITON_QUANTIZE"


def _same(fast: QuantizedTensor, ref: QuantizedTensor) -> None:
    assert fast.scheme == ref.scheme and fast.shape == ref.shape and fast.groups is ref.groups
    for which in ("rowwise", "columnwise"):
        a, b = getattr(fast, which), getattr(ref, which)
        assert (a is None) == (b is None), which
        if a is None:
            continue
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, which
        assert a.scale.dtype == b.scale.dtype == torch.float8_e8m0fnu and a.scale.shape == b.scale.shape, which
        diff = a.data.view(torch.uint8) != b.data.view(torch.uint8)
        assert not diff.any(), f"{which}: {int(diff.sum())} data bytes differ"
        assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8)), f"{which}: scale bytes differ"


def _both(monkeypatch: pytest.MonkeyPatch, fn):  # type: ignore[no-untyped-def]
    """(fn() through the Triton kernel, fn() eager), checking the kernel really ran the first time only."""
    from trainer.kernels import mxfp8_quant_triton as mxq

    calls: list[int] = []
    real = mxq.quantize
    monkeypatch.setattr(mxq, "quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.delenv(OFF, raising=False)
    fast = fn()
    assert calls, "the Triton MXFP8 kernel did not run"
    monkeypatch.setenv(OFF, "0")
    ref = fn()
    assert len(calls) == 1, "the eager reference went through the kernel"
    monkeypatch.delenv(OFF)
    return fast, ref


def _special(x: torch.Tensor) -> torch.Tensor:
    """Edge-case blocks along both directions of the last two dims."""
    x[..., 0, 0] = float("nan")  # a NaN block (scale byte 255, NaN bytes) in both copies
    x[..., 5, 40] = float("inf")
    x[..., 10:12, :] = 0.0  # all-zero rowwise blocks
    x[..., 3, 3] = 3e38  # huge amax
    x[..., 20, :] *= 1e-38  # tiny (subnormal) amax
    x[..., 30, 7] = -1e30
    return x


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("special", [False, True])
def test_grouped_weight_matches_eager_bitwise(monkeypatch, dtype, fmt, rounding, special):  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(7)
    # ragged: M and K not multiples of 32 or of the 64 x 64 tile; values over 60 orders of magnitude
    w = torch.randn(3, 70, 100, device="cuda", generator=g) * torch.logspace(-30, 30, 100, device="cuda")
    w = (_special(w) if special else w).to(dtype)
    scheme = Scheme("mx", fmt, block=(1, 32), mx_rounding=rounding)
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        fast, ref = _both(monkeypatch, lambda: quantize(w, scheme, rowwise=rowwise, columnwise=columnwise, recipe="m"))
        _same(fast, ref)


@gpu
def test_jagged_activation_matches_eager_bitwise(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    counts = [64, 0, 32, 160]  # groups start on multiples of 32 (the dispatcher's padding)
    T = sum(counts)
    x = _special(torch.randn(T, 96, device="cuda") * 4).to(torch.bfloat16)
    groups = TokenGroups.from_offsets(torch.tensor(counts, device="cuda").cumsum(0), T, validate=False)
    scheme = Scheme("mx", "e4m3", block=(1, 32))
    fast, ref = _both(monkeypatch, lambda: quantize(x, scheme, rowwise=True, columnwise=True, groups=groups))
    _same(fast, ref)


def test_not_selected_off_cuda_or_for_other_kinds() -> None:
    x = torch.randn(64, 64)
    assert not mx_triton_fast_path(x, Scheme("mx", "e4m3", block=(1, 32)))  # CPU
    if torch.cuda.is_available():
        xc = x.cuda()
        assert not mx_triton_fast_path(xc, Scheme("tensor", "e4m3"))
        assert not mx_triton_fast_path(xc, Scheme("mx", "e4m3", block=(32, 32)))
