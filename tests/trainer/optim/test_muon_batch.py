"""Newton-Schulz in bf16 against the fp32 iteration, and the batched Muon step against one param at a time.

bf16 tolerance, and why. bf16 keeps 8 significant bits: a rounding errs by at most u = 2^-9 ~ 0.002
relative. The fused bf16 chain rounds X, A = X X^T and B once per step (fp32 accumulation inside the
GEMMs), 15 roundings over 5 steps, of quantities whose entries in the singular bases are O(1); the
iteration's slope (up to a = 3.4 for small singular values) amplifies early errors. So:
- random matrices: ||O16 - O32||_F / ||O32||_F <= 0.025 (~13u; measured <= 0.015 over 6 seeds, CPU);
- ill-conditioned ones (singular values log-spaced over 3 and 6 decades), in G's singular bases
  (`U^T O V`, where the fp32 result is diagonal): on the directions bf16 resolves, those with a singular
  value >= 2^-6 of the top one (the input's rounding, u of the top value, is <= 1/8 of theirs), the same
  0.025 relative (measured <= 0.010 over 10 seeds); over all directions every entry of `U^T (O16 - O32) V`
  within 0.1 (measured <= 0.052). Directions below bf16's resolution hold rounding noise in the bf16
  input, which the iteration amplifies as it amplifies any small singular value: a relative bound there
  would test the noise, the absolute one tests that it stays noise-sized (no blow-up, no rotation of the
  resolved directions into them).
A wrong coefficient, a lost transpose or a normalisation in the wrong place errs by O(1). (The unfused
bf16 form, 5 roundings per step, measured 0.027 on random matrices: over the tolerance, as it should be.)

The Gram Newton-Schulz (`optimizer.muon_ns_method: gram`, `muon._iterate_gram`) is held to the same bounds
(its Gram side in fp16, a bf16 X: measured <= 0.010 random, <= 0.015 resolved, <= 0.033 per entry, CPU) and,
in fp32, to the standard iteration within fp32 rounding (the same polynomial; measured 3e-6 at 5 steps, 2.4e-5 at
7 on 6-decade matrices).
"""

from __future__ import annotations

import math

import pytest
import torch

from moectl.core.config.schema import OptimizerConfig
from moectl.core.facts import GluRows
from trainer.optim.muon import muon_update_, newton_schulz, resolve_compute_dtype, uses_gram
from trainer.optim.muon_batch import MuonMatrix, batches, fused_elementwise, muon_step_

RANDOM_TOL = 0.025
RESOLVED = 2.0**-6  # singular values bf16 resolves, relative to the top one
NOISE_ENTRY_TOL = 0.1
CUDA = [pytest.param("cuda", marks=pytest.mark.gpu)]
pytestmark = pytest.mark.usefixtures("one_thread")  # small GEMMs: thread start-up would dominate


def conditioned(m: int, n: int, decades: float, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(`U diag(S) V^T`, U, V, S) with singular values S log-spaced from 7 down to 7 * 10^-decades."""
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=gen))
    S = torch.logspace(0, -decades, k) * 7.0
    return U @ torch.diag(S) @ V.T, U, V, S


RANDOM_SHAPES = [(128, 256), (256, 128), (4, 128, 128), (3, 64, 192)]


def _track_random(device: str, dtype: torch.dtype, tol: float, gen: torch.Generator, method: str = "standard") -> None:
    """Newton-Schulz in `dtype` within `tol` (relative Frobenius, per slice) of fp32 on random matrices."""
    for shape in RANDOM_SHAPES:
        G = torch.randn(shape, generator=gen).to(device)
        o32, o16 = newton_schulz(G, 5), newton_schulz(G, 5, dtype, method)
        assert o16.dtype == dtype and o16.shape == G.shape
        err = (o16.float() - o32).norm(dim=(-2, -1)) / o32.norm(dim=(-2, -1))
        assert float(err.max()) <= tol, (shape, err)


def _track_conditioned(device: str, dtype: torch.dtype, tol: float, gen: torch.Generator, decades: float,
                       sizes: list[tuple[int, int]], method: str = "standard") -> None:  # fmt: skip
    """In `dtype` against fp32 on ill-conditioned matrices: within `tol` on the directions bf16 resolves, every
    entry in G's singular bases within `NOISE_ENTRY_TOL` (see the module docstring)."""
    for m, n in sizes:
        G, U, V, S = conditioned(m, n, decades, gen)
        o32 = newton_schulz(G.to(device), 5).cpu()
        o16 = newton_schulz(G.to(device), 5, dtype, method).float().cpu()
        diff, core = U.T @ (o16 - o32) @ V, U.T @ o32 @ V
        r = int((S >= RESOLVED * S[0]).sum())
        resolved = float(diff[:r, :r].norm() / core[:r, :r].norm())
        assert resolved <= tol, (m, n, r, resolved)
        assert float(diff.abs().max()) <= NOISE_ENTRY_TOL, (m, n, float(diff.abs().max()))


METHODS = ["standard", "gram"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("device", ["cpu", *CUDA])
def test_bf16_tracks_fp32_on_random_matrices(device: str, method: str) -> None:
    _track_random(device, torch.bfloat16, RANDOM_TOL, torch.Generator().manual_seed(0), method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("device", ["cpu", *CUDA])
@pytest.mark.parametrize("decades", [3, 6])
def test_bf16_tracks_fp32_on_ill_conditioned_matrices(device: str, decades: int, method: str) -> None:
    gen = torch.Generator().manual_seed(1)
    sizes = [(128, 256), (256, 128), (128, 128)]
    _track_conditioned(device, torch.bfloat16, RANDOM_TOL, gen, decades, sizes, method)


@pytest.mark.parametrize("decades", [0, 6])
def test_the_gram_iteration_in_fp32_is_the_standard_one(decades: int) -> None:
    """The same polynomial, regrouped: in fp32 the Gram form equals the reference within fp32 rounding, a
    wide slice, a tall one (iterated on its transpose) and a 7-step run (a restart and a one-step last phase).
    A wrong coefficient, a missing `a` term or a skipped R update errs by O(0.1)."""
    gen = torch.Generator().manual_seed(11)
    for m, n in [(64, 160), (160, 64)]:
        G = conditioned(m, n, decades, gen)[0] if decades else torch.randn(m, n, generator=gen)
        for steps in (5, 7):
            want, got = newton_schulz(G, steps), newton_schulz(G, steps, torch.float32, "gram")
            assert float((got - want).abs().max()) <= 1e-4, (m, n, steps)


def test_gram_restarts_keep_the_low_precision_iteration_on_track() -> None:
    """Why the Gram form restarts from a true X X^T every `GRAM_RESTART` steps: one phase of all 5 steps in
    bf16 lets rounding grow into the directions below bf16's resolution (spurious negative eigenvalues,
    amplified by a^2 per step) on a 6-decade matrix (measured 0.11-0.21 per entry over seeds 0-19); with the
    restarts it tracks fp32 within the bounds above (0.015-0.027)."""
    from trainer.optim.muon import _iterate_gram

    G, U, V, _ = conditioned(128, 256, 6, torch.Generator().manual_seed(14))
    o32 = newton_schulz(G, 5)
    X = (G / (G.norm() + 1e-7)).to(torch.bfloat16)
    errs = {r: float((U.T @ (_iterate_gram(X.clone(), 5, False, restart=r).float() - o32) @ V).abs().max())
            for r in (3, 5)}  # fmt: skip
    assert errs[3] <= NOISE_ENTRY_TOL and errs[5] > 3 * errs[3], errs  # measured 4.9-13x over seeds 0-19


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gram_iteration_keeps_a_tall_slice_contiguous(dtype: torch.dtype) -> None:
    """A tall slice iterates from the right (`X^T X`, `X Q`): the result is contiguous in the slice's own
    orientation, as the fused apply kernel that reads it requires, and equals iterating the transpose."""
    G = torch.randn(3, 96, 40, generator=torch.Generator().manual_seed(13))
    tall = newton_schulz(G, 5, dtype, "gram")
    wide = newton_schulz(G.mT.contiguous(), 5, dtype, "gram")
    assert tall.is_contiguous() and tall.shape == G.shape
    torch.testing.assert_close(tall.float(), wide.float().mT, rtol=0.02, atol=0.01)


FP16_TOL = 0.008  # fp16's folded chain: 2^-11 roundings, ~4x under bf16's (measured <= 0.0045, CPU)


@pytest.mark.parametrize("device", ["cpu", *CUDA])
def test_fp16_tracks_fp32_closer_than_bf16(device: str) -> None:
    """The fp16 chain on random and ill-conditioned matrices: on cuBLAS (the CPU) with a folded into B's diagonal,
    on CUDA the Triton GEMMs where the slices tile (no fold: the scaled input is added in the epilogue)."""
    gen = torch.Generator().manual_seed(8)
    _track_random(device, torch.float16, FP16_TOL, gen)
    _track_conditioned(device, torch.float16, FP16_TOL, gen, 6, [(128, 256), (256, 128)])


def _matrices(gen: torch.Generator, shapes: list[tuple[int, ...]]) -> list[MuonMatrix]:
    return [MuonMatrix(torch.randn(s, generator=gen), torch.randn(s, generator=gen), torch.randn(s, generator=gen))
            for s in shapes]


def _clone(mats: list[MuonMatrix]) -> list[MuonMatrix]:
    return [MuonMatrix(m.master.clone(), m.grad.clone(), m.momentum.clone()) for m in mats]


# Same-shaped 2-D params (like every layer's QKV or router), a grouped weight sharing their trailing shape,
# a lone 2-D param, tall and wide, and a Gram side of 8 (above MKL's small-GEMM sizes, see muon_batch).
SHAPES = [(48, 32), (8, 64), (48, 32), (3, 48, 32), (8, 64), (32, 80), (2, 48, 32), (8, 64)]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("cap", [1 << 28, 4000], ids=["one-batch-per-shape", "capped-batches"])
def test_batched_step_is_bitwise_one_param_at_a_time(nesterov: bool, cap: int) -> None:
    gen = torch.Generator().manual_seed(2)
    mats = _matrices(gen, SHAPES)
    ref = _clone(mats)
    grads = [m.grad.clone() for m in mats]
    hp = dict(lr=0.02, momentum=0.9, nesterov=nesterov, ns_steps=5, weight_decay=0.1)
    for _ in range(3):
        muon_step_(mats, compute_dtype=torch.float32, max_batch_elements=cap, **hp)  # type: ignore[arg-type]
        for r in ref:
            muon_update_(r.master, r.grad, r.momentum, **hp)  # type: ignore[arg-type]
    for m, r, g in zip(mats, ref, grads):
        assert torch.equal(m.master, r.master) and torch.equal(m.momentum, r.momentum), m.master.shape
        assert torch.equal(m.grad, g)  # grads are inputs only


def test_batches_group_by_trailing_shape_and_respect_the_cap() -> None:
    mats = _matrices(torch.Generator().manual_seed(3), SHAPES)
    shapes = [[tuple(m.master.shape) for m in run] for run in batches(mats)]
    assert shapes == [[(48, 32), (48, 32), (3, 48, 32), (2, 48, 32)], [(8, 64), (8, 64), (8, 64)], [(32, 80)]]
    capped = [[tuple(m.master.shape) for m in run] for run in batches(mats, max_elements=3 * 48 * 32)]
    assert capped == [[(48, 32), (48, 32)], [(3, 48, 32)], [(2, 48, 32)], [(8, 64), (8, 64), (8, 64)], [(32, 80)]]
    assert [[m.slices for m in run] for run in batches(mats)][0] == [1, 1, 3, 2]


@pytest.mark.parametrize("method", METHODS)
def test_bf16_step_tracks_the_fp32_step(method: str) -> None:
    """The same step with the iteration in bf16: the momentum is fp32 either way (bitwise equal), the update
    is the fp32 one within the random-matrix tolerance."""
    gen = torch.Generator().manual_seed(4)
    mats = _matrices(gen, [(64, 128), (3, 128, 64), (64, 128)])
    ref = _clone(mats)
    start = [m.master.clone() for m in mats]
    hp = dict(lr=0.01, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0)
    muon_step_(mats, compute_dtype=torch.bfloat16, ns_method=method, **hp)  # type: ignore[arg-type]
    muon_step_(ref, compute_dtype=torch.float32, **hp)  # type: ignore[arg-type]
    for m, r, p0 in zip(mats, ref, start):
        assert m.master.dtype == torch.float32 and torch.equal(m.momentum, r.momentum)
        d16, d32 = m.master - p0, r.master - p0
        assert float((d16 - d32).norm() / d32.norm()) <= RANDOM_TOL


def test_ns_method_resolution() -> None:
    """`auto` takes the Gram form only on the Triton GEMMs (never on the CPU, never for fp32); the explicit
    methods are taken as asked; anything else is refused."""
    wide = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    assert not uses_gram(wide, "auto") and not uses_gram(wide.float(), "auto")
    assert uses_gram(wide, "gram") and uses_gram(wide.float(), "gram") and not uses_gram(wide, "standard")
    with pytest.raises(ValueError, match="muon_ns_method"):
        uses_gram(wide, "gramm")


def test_compute_dtype_resolution() -> None:
    cpu = torch.device("cpu")
    assert resolve_compute_dtype("auto", cpu) == torch.float32
    assert resolve_compute_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_compute_dtype("float32", cpu) == torch.float32
    assert resolve_compute_dtype("float16", cpu) == torch.float16
    with pytest.raises(ValueError, match="muon_compute_dtype"):
        resolve_compute_dtype("float64", cpu)
    assert OptimizerConfig().muon_compute_dtype == "auto"


@pytest.mark.gpu
def test_auto_is_bf16_on_an_sm80_gpu() -> None:
    dev = torch.device("cuda")
    want = torch.bfloat16 if torch.cuda.get_device_capability(dev) >= (8, 0) else torch.float32
    assert resolve_compute_dtype("auto", dev) == want


@pytest.mark.gpu
def test_batched_step_on_cuda_equals_one_param_at_a_time_to_rounding() -> None:
    """CUDA may pick another GEMM kernel for a batch than for one matrix: equal to fp32 rounding, and
    bitwise where the batch is one matrix."""
    gen = torch.Generator().manual_seed(5)
    mats = [MuonMatrix(m.master.cuda(), m.grad.cuda(), m.momentum.cuda()) for m in _matrices(gen, SHAPES)]
    ref = _clone(mats)
    hp = dict(lr=0.02, momentum=0.9, nesterov=True, ns_steps=5, weight_decay=0.1)
    muon_step_(mats, compute_dtype=torch.float32, **hp)  # type: ignore[arg-type]
    for r in ref:
        muon_update_(r.master, r.grad, r.momentum, **hp)  # type: ignore[arg-type]
    for m, r in zip(mats, ref):
        torch.testing.assert_close(m.master, r.master, rtol=1e-5, atol=1e-6)
        assert torch.equal(m.momentum, r.momentum)
    lone = mats[5]  # (32, 80): the only matrix of its shape, so its batch is the 2-D matrix itself
    assert torch.equal(lone.master, ref[5].master)


def test_layerwise_muon_takes_the_configured_dtype() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_muon import chained_toy, train_step

    results = {}
    for name in ("float32", "bfloat16"):
        cfg = OptimizerConfig(lr=0.02, weight_decay=0.1, muon_compute_dtype=name)  # type: ignore[arg-type]
        model, dm, opt = chained_toy(cfg)
        assert opt.members[0].compute_dtype == getattr(torch, name)
        for step in range(2):
            train_step(dm, opt, step, cfg.lr)
        results[name] = model.experts.weight.detach().clone()
    a, b = results["float32"], results["bfloat16"]
    assert not torch.equal(a, b) and math.isclose(float((a - b).norm() / a.norm()), 0.0, abs_tol=0.02)


@pytest.mark.parametrize("nesterov", [True, False])
def test_grad_scale_is_the_clip_applied_first(nesterov: bool) -> None:
    """`grad_scale` (the clip coefficient) gives the bits of a step on grads multiplied by it beforehand."""
    gen = torch.Generator().manual_seed(6)
    mats = _matrices(gen, SHAPES)
    ref = _clone(mats)
    for r in ref:
        r.grad.mul_(0.375)
    hp = dict(lr=0.02, momentum=0.9, nesterov=nesterov, ns_steps=5, weight_decay=0.1)
    muon_step_(mats, compute_dtype=torch.float32, grad_scale=0.375, **hp)  # type: ignore[arg-type]
    muon_step_(ref, compute_dtype=torch.float32, **hp)  # type: ignore[arg-type]
    for m, r in zip(mats, ref):
        assert torch.equal(m.master, r.master) and torch.equal(m.momentum, r.momentum), m.master.shape


def test_tall_slices_iterate_from_the_right_as_the_transposed_wide_ones() -> None:
    """A tall batch iterates `X (aI + B)` with `B` from `X^T X`: the transposed wide iteration's result."""
    gen = torch.Generator().manual_seed(7)
    G = torch.randn(3, 96, 40, generator=gen)
    tall = newton_schulz(G, 5, torch.bfloat16)
    wide = newton_schulz(G.mT.contiguous(), 5, torch.bfloat16).mT
    assert tall.is_contiguous()
    torch.testing.assert_close(tall.float(), wide.float(), rtol=0.02, atol=0.01)


@pytest.mark.gpu
def test_the_two_stream_pipeline_gives_the_sequential_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch i's Newton-Schulz beside batch i-1's update and batch i+1's blend on a side stream: every kernel
    reads what it read in sequence (a missing wait would let a blend or an update read a half-written batch,
    or the allocator hand a live batch to the other stream), so masters and momenta are bitwise equal."""
    from trainer.optim import muon_batch

    gen = torch.Generator().manual_seed(5)
    shapes = [(4, 256, 512), (4, 256, 512), (2, 512, 256), (3, 256, 512), (256, 512), (2, 512, 256)]
    mats = [MuonMatrix(*(torch.randn(s, generator=gen).cuda() for _ in range(3))) for s in shapes]
    ref = _clone(mats)
    kw = dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.1, compute_dtype=torch.bfloat16,
              grad_scale=0.5, max_batch_elements=1 << 20)  # fmt: skip
    assert muon_batch._overlaps(list(batches(mats, 1 << 20)))
    for _ in range(3):
        muon_step_(mats, **kw)  # type: ignore[arg-type]
    monkeypatch.setenv(muon_batch.OVERLAP_ENV, "0")
    for _ in range(3):
        muon_step_(ref, **kw)  # type: ignore[arg-type]
    for m, r in zip(mats, ref):
        assert torch.equal(m.master, r.master) and torch.equal(m.momentum, r.momentum)


def _verdict_mats(device: str, seed: int) -> list[MuonMatrix]:
    """Wide, tall and grouped matrices, some publishing into a bf16 param, one gated fc1 with interleaved
    gate/up blocks (its batch slot gathered) and one with `[gate; up]` rows: every branch of the step."""
    gen = torch.Generator().manual_seed(seed)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device)

    shapes = [(64, 128), (2, 64, 128), (128, 64), (64, 128)]
    mats = [MuonMatrix(t(*s), t(*s), t(*s), publish=t(*s).bfloat16() if i % 2 else None)
            for i, s in enumerate(shapes)]
    mats.append(MuonMatrix(t(128, 64), t(128, 64), t(128, 64), glu=GluRows(16), publish=t(128, 64).bfloat16()))
    mats.append(MuonMatrix(t(2, 128, 64), t(2, 128, 64), t(2, 128, 64), glu=GluRows()))
    return mats


def _state(mats: list[MuonMatrix]) -> list[torch.Tensor]:
    return [t.clone() for m in mats for t in (m.master, m.momentum, m.grad, m.publish) if t is not None]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("clip", [True, False], ids=["clipped", "clip-off"])
def test_the_verdict_on_the_device_gives_the_host_bits_and_a_set_flag_writes_nothing(device: str, nesterov: bool,
                                                                                     clip: bool) -> None:
    """The clip coefficient as an fp32 device tensor and `found_inf` as a device flag (the update queued before
    the host reads the norm, layerwise.LayerWiseMuon.device_verdict): with the flag 0 the bits of the host
    coefficient's step, on the torch path and (CUDA, bf16) on the fused kernels; with the flag 1 every master,
    momentum, grad and published param keeps its bits. A coefficient read wrongly (or ignored) moves every
    element of the update; a flag ignored moves every master."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the device tool)")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hp = dict(lr=0.02, momentum=0.9, nesterov=nesterov, ns_steps=5, weight_decay=0.1, compute_dtype=dtype)
    # clipped: the grads scaled by a factor that rounds in fp32, passed as a device tensor; clipping off: the
    # host float 1.0 with only the flag on the device (`LayerWiseMuon` with `clip_grad: 0`)
    coef = 0.3718 if clip else 1.0
    host, dev = _verdict_mats(device, 8), _verdict_mats(device, 8)
    grads = [m.grad.clone() for m in dev]
    muon_step_(host, grad_scale=coef, **hp)  # type: ignore[arg-type]
    flag = torch.zeros((), device=device)
    dev_coef = torch.tensor(coef, dtype=torch.float64, device=device).float() if clip else 1.0
    muon_step_(dev, grad_scale=dev_coef, found_inf=flag, **hp)  # type: ignore[arg-type]
    for h, d, g in zip(host, dev, grads):
        assert torch.equal(h.master, d.master) and torch.equal(h.momentum, d.momentum), h.master.shape
        assert h.publish is None or torch.equal(h.publish, d.publish)  # type: ignore[arg-type]
        assert torch.equal(d.grad, g)  # the device path never scales the grads in place
    before = _state(dev)
    muon_step_(dev, grad_scale=torch.tensor(float("nan"), device=device) if clip else 1.0, found_inf=flag + 1,
               **hp)  # type: ignore[arg-type]
    for a, b in zip(_state(dev), before):
        assert torch.equal(a, b)
    fused = [fused_elementwise(run, dtype) for run in batches(dev)]
    assert fused == ([True, True, False] if device == "cuda" else [False] * 3)  # both paths ran on CUDA
