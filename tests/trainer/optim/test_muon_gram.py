"""The Gram Newton-Schulz driver (trainer/optim/muon_gram.py) on the CPU, with the torch symmetric products.

The same `iterate_gram` runs on CUDA with the Triton `symm_`, so these tests cover that path's logic in CI:
the normalisation folded in (`s^2` in the first Gram, `s` in the first phase's last Q, fp16 scaled first),
phases of 1 to 3 steps, tall slices from the right, the buffers (no product may write what it reads), a zero
slice. Tolerances as in tests/trainer/optim/test_muon_batch.py (bf16: 0.025 relative Frobenius against fp32).
"""

from __future__ import annotations

import pytest
import torch

from trainer.optim import muon
from trainer.optim.muon_gram import iterate_gram, symm_torch

RANDOM_TOL = 0.025
pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm(dim=(-2, -1)) / b.float().norm(dim=(-2, -1))).max())


def test_symm_torch_is_the_formula_rounded_once_and_mirrored() -> None:
    """Against an fp64 reference: within half an fp16 ulp of each entry (one rounding of the whole sum; rounding
    the product before the added terms errs by more), both scale powers, the upper triangle kept."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, 40, generator=gen, dtype=torch.float64)
    A = x @ x.mT / 40
    P, S = (A @ A - 0.5 * A).half(), (2.0 * A + A @ A @ A).half()
    Pd, Sd = P.double(), S.double()
    s = torch.tensor([0.5, 3.0])
    for power in (1, 2):
        out = torch.empty(2, 24, 24, dtype=torch.float16)
        symm_torch(P, S, out, alpha=0.7, beta=3.4, c=S, beta2=-1.5, c2=P, diag=2.0, scale=s, scale_power=power)
        full = s.double()[:, None, None] ** power * (0.7 * Pd @ Sd.mT + 3.4 * Sd - 1.5 * Pd
                                                     + 2.0 * torch.eye(24, dtype=torch.float64))  # fmt: skip
        want = torch.triu(full) + torch.triu(full, diagonal=1).mT  # the upper triangle, mirrored
        ulp = torch.finfo(torch.float16).eps * want.abs().clamp(min=torch.finfo(torch.float16).tiny)
        assert torch.equal(out, out.mT)
        assert bool(((out.double() - want).abs() <= 0.5 * ulp * 1.001).all()), power


def test_symm_torch_refuses_what_the_kernel_cannot_take() -> None:
    t = torch.zeros(1, 4, 4)
    with pytest.raises(ValueError, match="scale_power"):
        symm_torch(t, t, torch.empty_like(t), scale_power=3)
    with pytest.raises(ValueError, match="out is one of its inputs"):
        symm_torch(t, t, t)
    with pytest.raises(ValueError, match="symm of"):
        symm_torch(t, torch.zeros(1, 4, 5), torch.empty_like(t))


@pytest.mark.parametrize("restart", [3, 5])
def test_the_gram_products_are_the_measured_kernel_calls(restart: int) -> None:
    """On CUDA `symm_` picks its kernel by `z is y` (a Gram: no diagonal mirroring, one operand descriptor): the
    Gram of X, each `Z = b R + c R^2` and a one-step phase's Q pass one tensor twice, nothing else does. For 5
    steps in phases of 3 and 2: 16 products (10 + 6); in one phase of 5: 18."""
    calls: list[bool] = []

    def recording(y, z, out, **kw):  # type: ignore[no-untyped-def]
        calls.append(z is y)
        return symm_torch(y, z, out, **kw)

    X = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    iterate_gram(X, 5, muon.NS_COEFFICIENTS, False, None, torch.float16, restart, recording)
    phase = {3: [True, True, False, False, True, False, False, False, True, False],
             2: [True, True, False, False, True, False],
             5: [True, True, False, False] + [True, False, False, False] * 3 + [True, False]}  # fmt: skip
    assert calls == (phase[3] + phase[2] if restart == 3 else phase[5])
    calls.clear()
    iterate_gram(X, 1, muon.NS_COEFFICIENTS, False, None, torch.float16, restart, recording)
    assert calls == [True, True]  # the Gram of X, then Q = a I + b R + c R^2 from R alone


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tall", [False, True])
def test_the_folded_normalisation_tracks_fp32_for_every_phase_length(tall: bool, dtype: torch.dtype) -> None:
    """Slices whose norms differ by 5 decades, X not normalised (as `muon_step_` hands it over), 1 to 7 steps
    (phases of 1, 2 and 3 steps, zero to two restarts): within the bf16 tolerance of fp32, X's strides kept;
    `symm_torch` refuses any product that writes its own input."""
    gen = torch.Generator().manual_seed(1)
    shape = (3, 64, 32) if tall else (3, 32, 64)
    G = torch.randn(shape, generator=gen) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    X = G.to(dtype)
    scale = (X.float().norm(dim=(-2, -1)) + muon.NS_EPS).reciprocal()
    for steps in range(1, 8):
        out = iterate_gram(X.clone(), steps, muon.NS_COEFFICIENTS, tall, scale, muon.gram_dtype(dtype),
                           muon.GRAM_RESTART, symm_torch)  # fmt: skip
        assert out.stride() == X.stride() and out.dtype == dtype
        assert _rel(out, muon.newton_schulz(G, steps)) <= RANDOM_TOL, steps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_zero_slice_stays_zero(dtype: torch.dtype) -> None:
    """An expert without tokens: zero momentum, scale 1 / eps = 1e7. bf16 takes `s Q` (~4e8) in range; fp16
    scales X first. Either way the slice stays exactly zero and nothing is NaN."""
    X = torch.zeros(2, 32, 64, dtype=dtype)
    X[1] = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    scale = (X.float().norm(dim=(-2, -1)) + muon.NS_EPS).reciprocal()
    out = iterate_gram(X.clone(), 5, muon.NS_COEFFICIENTS, False, scale, muon.gram_dtype(dtype), muon.GRAM_RESTART,
                       symm_torch)  # fmt: skip
    assert torch.isfinite(out).all() and not out[0].any() and out[1].float().norm() > 1
