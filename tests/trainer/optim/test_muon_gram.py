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


def _checked(symm):  # type: ignore[no-untyped-def]
    """`symm` that refuses to write a tensor it reads (the kernels read tiles other programs write)."""

    def run(y, z, out, **kw):  # type: ignore[no-untyped-def]
        for t in (y, z, kw.get("c"), kw.get("c2")):
            assert t is None or t.data_ptr() != out.data_ptr(), "a product writes its own input"
        return symm(y, z, out, **kw)

    return run


def test_symm_torch_is_the_formula_and_exactly_symmetric() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, 40, generator=gen)
    A = x @ x.mT / 40
    P, S = A @ A - 0.5 * A, 2.0 * A + A @ A @ A
    s = torch.tensor([0.5, 3.0])
    out = torch.empty(2, 24, 24, dtype=torch.float16)
    symm_torch(P, S, out, alpha=0.7, beta=3.4, c=S, beta2=-1.5, c2=P, diag=2.0, scale=s, scale_power=1)
    want = s[:, None, None] * (0.7 * P @ S + 3.4 * S - 1.5 * P + 2.0 * torch.eye(24))
    assert torch.equal(out, out.mT)
    torch.testing.assert_close(out.float(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tall", [False, True])
def test_the_folded_normalisation_tracks_fp32_for_every_phase_length(tall: bool, dtype: torch.dtype) -> None:
    """Slices whose norms differ by 5 decades, X not normalised (as `muon_step_` hands it over), 1 to 7 steps
    (phases of 1, 2 and 3 steps, one to three restarts): within the bf16 tolerance of fp32, X's strides kept."""
    gen = torch.Generator().manual_seed(1)
    shape = (3, 64, 32) if tall else (3, 32, 64)
    G = torch.randn(shape, generator=gen) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    X = G.to(dtype)
    scale = (X.float().norm(dim=(-2, -1)) + muon.NS_EPS).reciprocal()
    for steps in range(1, 8):
        out = iterate_gram(X.clone(), steps, muon.NS_COEFFICIENTS, tall, scale, muon.gram_dtype(dtype),
                           muon.GRAM_RESTART, _checked(symm_torch))  # fmt: skip
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
