"""Muon's Triton Newton-Schulz GEMMs (trainer/kernels/ns_gemm_triton.py) against torch's products.

GPU tests (marked `gpu`). Each kernel against the fp32 product of the same bf16 inputs: one rounding of the
fp32 result to bf16 (2^-9 relative) plus fp32 accumulation in another order, so within 2^-8 of the result's
scale; the Gram outputs exactly symmetric (the mirror tile stores the same rounded values). The whole
iteration within the bf16 tolerance of the fp32 iteration (0.025, tests/trainer/optim/test_muon_batch.py) at
the reference model's slice shapes, tall ones on the transposed views, and bit-reproducible run to run. A
wrong tile mapping, a missing mirror store or a transposed operand errs by O(1). Each runs twice on Hopper:
with the TMA kernels (the default there) and with the pointer kernels (`MOECTL_NS_TMA=0`, every other GPU);
the iteration with either `B X` product (`MOECTL_NS_BX`: cuBLAS after folding `a I` into B, or Triton).

CPU test: never selected off CUDA.
"""

from __future__ import annotations

import pytest
import torch

from trainer.optim import muon
from trainer.optim.muon_gram import iterate_gram

gpu = pytest.mark.gpu
RANDOM_TOL = 0.025
ROUNDING = 2.0**-8


def test_not_selected_off_cuda() -> None:
    assert not muon._use_triton(torch.zeros(2, 128, 256, dtype=torch.bfloat16))


KERNELS = {"pointer": "0", "tma": "1"}


@pytest.fixture(params=list(KERNELS))
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on each kernel family: pointer loads or TMA (the choice is made per call)."""
    monkeypatch.setenv("MOECTL_NS_TMA", KERNELS[request.param])
    if request.param != "pointer" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0")
    return request.param


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = float((got.float() - want).abs().max() / want.abs().max())
    assert err <= ROUNDING, err


@gpu
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("m", [256, 384])  # even tile count: two row tiles per TMA program; odd: one
def test_gram_is_the_symmetric_product(strided: bool, m: int, kernels: str) -> None:
    from trainer.kernels import ns_gemm_triton as K

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 384, m, device="cuda", generator=gen, dtype=torch.bfloat16)
    y = x.mT if strided else x.mT.contiguous()  # [3, m, 384]: a tall slice's transposed view, or contiguous
    out = torch.empty(3, y.shape[1], y.shape[1], device="cuda", dtype=torch.bfloat16)
    K.gram_(y, out)
    _close(out, y.float() @ y.float().mT)
    assert torch.equal(out, out.mT)
    c = out / out.abs().max()
    out2 = torch.empty_like(out)
    K.gram_(c, out2, alpha=2.0315, beta=-4.775, c=c)
    _close(out2, -4.775 * c.float() + 2.0315 * c.float() @ c.float())
    assert torch.equal(out2, out2.mT)
    # B' = s (a I + b C + c C C), the first step's B with `a` and the scale folded in (the cuBLAS B X path)
    s = torch.tensor([0.5, 2.0, 3.0], device="cuda")
    K.gram_(c, out2, alpha=2.0315, beta=-4.775, c=c, diag=3.4445, scale=s, scale_power=1)
    eye = torch.eye(c.shape[-1], device="cuda")
    _close(out2, s[:, None, None] * (3.4445 * eye - 4.775 * c.float() + 2.0315 * c.float() @ c.float()))
    assert torch.equal(out2, out2.mT)


@gpu
@pytest.mark.parametrize("strided", [False, True])
def test_two_row_tiles_per_program_give_the_one_tile_bits(strided: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The TMA Gram with ROWS 2 (even tile counts, the default) and with ROWS 1 (`MOECTL_NS_GRAM2=0`) sum the
    same products in the same K order: bitwise equal, for the Gram and for B with every epilogue term. A row
    tile paired with the wrong column tile, or the lower tile stored on the diagonal, changes bits."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the two-tile kernel is the TMA one (compute capability 9.0)")
    from trainer.kernels import ns_gemm_triton as K

    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(3, 512, 1024, device="cuda", generator=gen, dtype=torch.bfloat16)
    y = x.mT if strided else x.mT.contiguous()  # [3, 1024, 512]: 8 tiles a side
    s = torch.tensor([0.5, 2.0, 3.0], device="cuda")
    outs = []
    for two in ("1", "0"):
        monkeypatch.setenv("MOECTL_NS_GRAM2", two)
        assert K._two_row_tiles(1024) is (two == "1")
        A = K.gram_(y, torch.empty(3, 1024, 1024, device="cuda", dtype=torch.bfloat16), scale=s)
        c = A / A.abs().max()
        B = K.gram_(c, torch.empty_like(A), alpha=2.0315, beta=-4.775, c=c, diag=3.4445, scale=s, scale_power=1)
        outs.append((A, B))
    (a2, b2), (a1, b1) = outs
    assert torch.equal(a2, a1) and torch.equal(b2, b1)
    _close(a1, (s[:, None, None] ** 2) * (y.float() @ y.float().mT))


@gpu
def test_axpby_is_the_product_plus_the_scaled_input_on_strided_views(kernels: str) -> None:
    from trainer.kernels import ns_gemm_triton as K

    gen = torch.Generator(device="cuda").manual_seed(1)
    l = torch.randn(2, 256, 256, device="cuda", generator=gen).to(torch.bfloat16)
    l = (l + l.mT) / 2
    wide = torch.randn(2, 256, 512, device="cuda", generator=gen).to(torch.bfloat16)
    tall_t = torch.randn(2, 512, 256, device="cuda", generator=gen).to(torch.bfloat16).mT  # strided [2, 256, 512]
    for r, out in ((wide, torch.empty_like(wide)), (tall_t, torch.empty_like(tall_t.mT).mT)):
        K.axpby_(l, r, out, 3.4445)
        _close(out, l.float() @ r.float() + 3.4445 * r.float())


@pytest.fixture(params=["cublas", "triton"])
def bx(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on each `B X` product: cuBLAS after `a I` folded into B, or the Triton kernel adding `a X`."""
    monkeypatch.setenv("MOECTL_NS_BX", request.param)
    return request.param


@gpu
@pytest.mark.parametrize("shape", [(4, 1024, 2048), (4, 2048, 1024), (2, 3072, 2048)])
def test_the_iteration_tracks_fp32_and_is_reproducible(shape: tuple[int, int, int], kernels: str, bx: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    G = torch.randn(shape, device="cuda", generator=gen)
    X = G.to(torch.bfloat16)
    assert muon._use_triton(X)
    o32 = muon.newton_schulz(G, 5)
    o16 = muon.newton_schulz(X, 5, torch.bfloat16)
    again = muon.newton_schulz(X, 5, torch.bfloat16)
    assert o16.shape == G.shape and o16.is_contiguous()
    err = (o16.float() - o32).norm(dim=(-2, -1)) / o32.norm(dim=(-2, -1))
    assert float(err.max()) <= RANDOM_TOL, err
    assert torch.equal(o16, again)


@gpu
def test_the_switch_keeps_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    X = torch.randn(2, 256, 512, device="cuda").to(torch.bfloat16)
    tri = muon.newton_schulz(X, 5, torch.bfloat16)
    monkeypatch.setenv(muon.TRITON_NS_ENV, "0")
    assert not muon._use_triton(X)
    cub = muon.newton_schulz(X, 5, torch.bfloat16)
    assert not torch.equal(tri, cub)  # another kernel, other roundings, the same result within bf16
    assert float((tri.float() - cub.float()).norm() / cub.float().norm()) <= RANDOM_TOL


@gpu
@pytest.mark.parametrize("tall", [False, True])
def test_the_normalisation_folds_into_the_first_step(tall: bool, kernels: str, bx: str) -> None:
    """Scaling the first step's products by each slice's 1 / (|X| + eps) is normalising X first: equal within
    the bf16 roundings the fold skips (X / |X| is never rounded), for slices of very different norms."""
    from trainer.kernels import ns_gemm_triton as K

    gen = torch.Generator(device="cuda").manual_seed(3)
    shape = (3, 512, 256) if tall else (3, 256, 512)
    G = torch.randn(shape, device="cuda", generator=gen) * torch.tensor([1e-3, 1.0, 50.0], device="cuda")[:, None, None]
    X = G.to(torch.bfloat16)
    norm = X.float().norm(dim=(-2, -1))
    first = K.iterate((X / (norm + muon.NS_EPS)[:, None, None]).to(torch.bfloat16), 5, muon.NS_COEFFICIENTS, tall)
    folded = K.iterate(X.clone(), 5, muon.NS_COEFFICIENTS, tall, (norm + muon.NS_EPS).reciprocal())
    err = (folded.float() - first.float()).norm(dim=(-2, -1)) / first.float().norm(dim=(-2, -1))
    assert float(err.max()) <= RANDOM_TOL, err
    assert folded.stride() == X.stride()


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_zero_slice_stays_zero_with_the_scale_folded_in(dtype: torch.dtype, bx: str) -> None:
    """An expert that got no tokens has a zero momentum: its scale is 1 / eps = 1e7. On the cuBLAS product
    the first step's B' = s (a I + ...) would overflow fp16 (inf * 0 = NaN), so fp16 scales that step in
    axpby_'s fp32 epilogue; bf16 has the range."""
    from trainer.kernels import ns_gemm_triton as K

    X = torch.zeros(2, 256, 512, device="cuda", dtype=dtype)
    X[1] = torch.randn(256, 512, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5)).to(dtype)
    norm = X.float().norm(dim=(-2, -1))
    out = K.iterate(X.clone(), 5, muon.NS_COEFFICIENTS, False, (norm + muon.NS_EPS).reciprocal())
    assert torch.isfinite(out).all() and not out[0].any()
    assert out[1].float().norm() > 1  # the other slice was orthogonalised


@gpu
@pytest.mark.parametrize("m", [256, 384])
def test_symm_is_the_product_of_commuting_symmetric_matrices(m: int, kernels: str) -> None:
    """`symm_` of two polynomials in one symmetric matrix (they commute, so the product is symmetric), fp16 in and
    bf16 out, as the Gram Newton-Schulz runs it: the product alone, then each added input, the diagonal and the
    scale, each within one rounding of the fp32 result and exactly symmetric. Every term is O(1) (A's top
    eigenvalue is 1), so a missing or swapped term errs by O(1), far above the rounding bound."""
    from trainer.kernels import ns_gemm_triton as K

    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(2, m, 2 * m, device="cuda", generator=gen)
    A = x @ x.mT
    A = A / torch.linalg.matrix_norm(A, ord=2)[:, None, None]  # eigenvalues in [0, 1]
    P, S = (3.4 * A - 4.7 * A @ A).half(), (2.0 * A + A @ A @ A).half()
    Pf, Sf = P.float(), S.float()
    eye = torch.eye(m, device="cuda")
    s = torch.tensor([0.5, 3.0], device="cuda")
    cases = [(dict(), Pf @ Sf), (dict(beta=3.4445, c=S), Pf @ Sf + 3.4445 * Sf),
             (dict(beta2=-1.5, c2=P), Pf @ Sf - 1.5 * Pf), (dict(diag=0.7), Pf @ Sf + 0.7 * eye),
             (dict(beta=3.4445, c=S, beta2=-1.5, c2=P, diag=0.7, scale=s, scale_power=1),
              s[:, None, None] * (Pf @ Sf + 3.4445 * Sf - 1.5 * Pf + 0.7 * eye))]  # fmt: skip
    for kwargs, want in cases:
        out = torch.empty(2, m, m, device="cuda", dtype=torch.bfloat16)
        K.symm_(P, S, out, **kwargs)
        _close(out, want)
        assert torch.equal(out, out.mT), kwargs


@gpu
@pytest.mark.parametrize("shape", [(4, 1024, 2048), (4, 2048, 1024), (3, 256, 1024)])
def test_the_gram_iteration_on_triton_is_the_torch_form(shape: tuple[int, int, int], kernels: str) -> None:
    """The Gram iteration on the Triton `symm_` rounds where the torch one (`muon._iterate_gram`) does, in another
    summation order: both track fp32 within the bf16 tolerance, they agree within 0.02 (rounding noise: two CPU
    runs whose inputs differ by a 2^-10 rescale differ by 0.008), and the Triton one is bit-reproducible.
    Through `newton_schulz` (X normalised first; `test_the_normalisation_folds_into_the_gram_iteration` takes
    muon_step_'s folded path)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    G = torch.randn(shape, device="cuda", generator=gen)
    X = G.to(torch.bfloat16)
    assert muon._use_triton(X) and muon.uses_gram(X, "auto") == (max(shape[1:]) >= 2 * min(shape[1:]))
    o32 = muon.newton_schulz(G, 5)
    tri = muon.newton_schulz(X, 5, torch.bfloat16, "gram")
    again = muon.newton_schulz(X, 5, torch.bfloat16, "gram")
    ref = muon._iterate_gram(X / (X.float().norm(dim=(-2, -1), keepdim=True) + muon.NS_EPS).to(torch.bfloat16), 5,
                             shape[1] > shape[2])  # fmt: skip
    assert tri.shape == G.shape and tri.is_contiguous() and torch.equal(tri, again)
    rel = lambda a, b: float(((a.float() - b.float()).norm(dim=(-2, -1)) / b.float().norm(dim=(-2, -1))).max())
    assert rel(tri, o32) <= RANDOM_TOL and rel(ref, o32) <= RANDOM_TOL
    assert rel(tri, ref) <= 0.02


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tall", [False, True])
def test_the_normalisation_folds_into_the_gram_iteration(tall: bool, dtype: torch.dtype, kernels: str) -> None:
    """The path `muon_step_` runs: the blend's sums of squares give each slice's `s = 1 / (|X| + eps)`, which the
    Gram iteration takes as `s^2` in its first Gram and `s` in the first phase's last Q (fp16: X scaled first).
    For slices of very different norms, within the bf16 tolerance of fp32 and of normalising X first; the
    result keeps X's strides."""
    from trainer.kernels import ns_gemm_triton as K

    gen = torch.Generator(device="cuda").manual_seed(8)
    shape = (3, 512, 256) if tall else (3, 256, 512)
    G = torch.randn(shape, device="cuda", generator=gen) * torch.tensor([1e-3, 1.0, 50.0], device="cuda")[:, None, None]
    X = G.to(dtype)
    norm = X.float().norm(dim=(-2, -1))
    args = (5, muon.NS_COEFFICIENTS, tall)
    first = iterate_gram((X / (norm + muon.NS_EPS)[:, None, None]).to(dtype), *args, None, muon.gram_dtype(dtype),
                         muon.GRAM_RESTART, K.symm_)  # fmt: skip
    folded = iterate_gram(X.clone(), *args, (norm + muon.NS_EPS).reciprocal(), muon.gram_dtype(dtype),
                          muon.GRAM_RESTART, K.symm_)  # fmt: skip
    o32 = muon.newton_schulz(G, 5)
    rel = lambda a, b: float(((a.float() - b.float()).norm(dim=(-2, -1)) / b.float().norm(dim=(-2, -1))).max())
    assert rel(folded, o32) <= RANDOM_TOL and rel(folded, first) <= RANDOM_TOL
    assert folded.stride() == X.stride()


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_zero_slice_stays_zero_in_the_gram_iteration(dtype: torch.dtype) -> None:
    """A zero slice's scale is 1 / eps: the Gram side stays 0 and the first phase's s Q (4e8 for bf16) is
    finite; fp16 normalises X first instead (s Q would overflow it)."""
    from trainer.kernels import ns_gemm_triton as K

    X = torch.zeros(2, 256, 512, device="cuda", dtype=dtype)
    X[1] = torch.randn(256, 512, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5)).to(dtype)
    norm = X.float().norm(dim=(-2, -1))
    out = iterate_gram(X.clone(), 5, muon.NS_COEFFICIENTS, False, (norm + muon.NS_EPS).reciprocal(),
                       muon.gram_dtype(dtype), muon.GRAM_RESTART, K.symm_)  # fmt: skip
    assert torch.isfinite(out).all() and not out[0].any()
    assert out[1].float().norm() > 1
