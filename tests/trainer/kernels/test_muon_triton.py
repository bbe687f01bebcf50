"""Muon's fused elementwise kernels (trainer/kernels/muon_triton.py) against the torch path of `muon_step_`.

GPU tests (marked `gpu`): the blend (momentum EMA, Nesterov blend cast to bf16, per-slice sums of squares),
the apply (decay and scaled update of the fp32 master), and a whole `muon_step_` with the kernels against the
same step on the torch path (selected off by patching `fused_elementwise`). Tolerances: the momentum is the
same fp32 formula (torch's lerp branches) up to FMA contraction, so within 1e-6 relative; the bf16 blend
within one bf16 ulp (2^-7 relative at worst); the sums of squares in another (fixed) order, 1e-4 relative; the whole step's
update, like the torch path's, within the bf16 tolerance (0.025 relative) of the fp32 step: the two bf16 steps
differ by roundings of that size (the torch path rounds each slice's norm to bf16, the kernel keeps it in fp32),
measured 1.3-1.5% apart. A lost clip, a swapped lerp weight or a wrong slice index errs by O(1).

CPU test: the kernels are never selected off CUDA.
"""

from __future__ import annotations

import pytest
import torch

from trainer.kernels import has_triton
from trainer.optim import muon_batch
from trainer.optim.muon_batch import MuonMatrix, fused_elementwise, muon_step_

gpu = pytest.mark.gpu
RANDOM_TOL = 0.025  # bf16 vs fp32 Newton-Schulz, tests/trainer/optim/test_muon_batch.py


def _mats(shapes: list[tuple[int, ...]], device: str, seed: int = 0) -> list[MuonMatrix]:
    gen = torch.Generator().manual_seed(seed)
    return [MuonMatrix(*(torch.randn(s, generator=gen).to(device) for _ in range(3))) for s in shapes]


def _clone(mats: list[MuonMatrix]) -> list[MuonMatrix]:
    return [MuonMatrix(m.master.clone(), m.grad.clone(), m.momentum.clone()) for m in mats]


def test_not_selected_off_cuda() -> None:
    mats = _mats([(64, 128)], "cpu")
    assert not fused_elementwise(mats, torch.bfloat16)


needs_kernels = pytest.mark.skipif(not (torch.cuda.is_available() and has_triton()), reason="needs CUDA and Triton")


@gpu
@needs_kernels
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("coef", [1.0, 0.3])
def test_blend_matches_the_torch_ops(nesterov: bool, coef: float) -> None:
    from trainer.kernels import muon_triton
    from trainer.optim.grad_norm import clipped

    g, m = torch.randn(2, 3, 128, 256, device="cuda").unbind(0)
    out = torch.empty(3, 128, 256, dtype=torch.bfloat16, device="cuda")
    per_slice = 128 * 256 // muon_triton.BLOCK
    partials = torch.zeros(5 * per_slice, device="cuda")  # a batch of 5 slices; this matrix is slices 2-4
    m_ref = m.clone()
    muon_triton.blend_(g, m, out, partials, 2 * per_slice, coef=coef, beta=0.95, nesterov=nesterov)
    sumsq = muon_triton.slice_sums(partials, 128 * 256)
    gc = clipped(g.clone(), coef)
    m_ref.lerp_(gc, 1 - 0.95)
    ref = (torch.lerp(gc, m_ref, 0.95) if nesterov else m_ref).bfloat16()
    torch.testing.assert_close(m, m_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-6)
    want = (ref.float() ** 2).sum(dim=(-2, -1))
    assert float(sumsq[:2].abs().max()) == 0.0
    torch.testing.assert_close(sumsq[2:], want, rtol=1e-4, atol=0)


@gpu
@needs_kernels
def test_apply_and_normalize_match_the_torch_ops() -> None:
    from trainer.kernels import muon_triton

    p, o = torch.randn(4, 256, 64, device="cuda"), torch.randn(4, 256, 64, device="cuda").bfloat16()
    ref = p.clone().mul_(0.999).add_(o, alpha=-0.05)
    p2, published = p.clone(), torch.zeros(4, 256, 64, dtype=torch.bfloat16, device="cuda")
    muon_triton.apply_(p, o, decay=0.999, alpha=-0.05)
    torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)
    muon_triton.apply_(p2, o, decay=0.999, alpha=-0.05, publish=published)
    assert torch.equal(p2, p) and torch.equal(published, p.bfloat16())  # the cast staging's copy_ makes
    X = torch.randn(4, 256, 64, device="cuda").bfloat16()
    s = (X.float() ** 2).sum(dim=(-2, -1))
    ref = (X.float() / (s.sqrt() + 1e-7)[:, None, None]).bfloat16()
    muon_triton.normalize_(X, s, 1e-7)
    torch.testing.assert_close(X.float(), ref.float(), rtol=2**-7, atol=0)


@gpu
@needs_kernels
def test_fused_step_is_bit_reproducible() -> None:
    """No atomics in the sums of squares: the same step twice gives the same bits (graph == eager relies on it)."""
    shapes = [(128, 256), (3, 128, 256), (2, 512, 128)]
    hp = dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.1, grad_scale=0.5)
    runs = []
    for _ in range(2):
        mats = _mats(shapes, "cuda", seed=3)
        muon_step_(mats, compute_dtype=torch.bfloat16, **hp)  # type: ignore[arg-type]
        runs.append([(m.master, m.momentum) for m in mats])
    for (p, q), (p2, q2) in zip(*runs):
        assert torch.equal(p, p2) and torch.equal(q, q2)


@gpu
@needs_kernels
@pytest.mark.parametrize("nesterov", [True, False])
def test_fused_step_tracks_the_torch_step(monkeypatch: pytest.MonkeyPatch, nesterov: bool) -> None:
    # wide and tall grouped weights sharing a trailing shape with 2-D ones, and a lone tall 2-D matrix
    shapes = [(128, 256), (3, 128, 256), (128, 256), (2, 512, 128), (512, 128), (1024, 64)]
    mats = _mats(shapes, "cuda", seed=1)
    torch_bf16, torch_fp32 = _clone(mats), _clone(mats)
    start = [m.master.clone() for m in mats]
    grads = [m.grad.clone() for m in mats]
    hp = dict(lr=0.02, momentum=0.95, nesterov=nesterov, ns_steps=5, weight_decay=0.1, grad_scale=0.5)
    assert all(fused_elementwise([m], torch.bfloat16) for m in mats)
    muon_step_(mats, compute_dtype=torch.bfloat16, **hp)  # type: ignore[arg-type]
    monkeypatch.setattr(muon_batch, "fused_elementwise", lambda run, dtype: False)
    muon_step_(torch_bf16, compute_dtype=torch.bfloat16, **hp)  # type: ignore[arg-type]
    muon_step_(torch_fp32, compute_dtype=torch.float32, **hp)  # type: ignore[arg-type]
    for m, r, r32, p0, g in zip(mats, torch_bf16, torch_fp32, start, grads):
        torch.testing.assert_close(m.momentum, r.momentum, rtol=1e-6, atol=1e-7)
        assert torch.equal(m.grad, g)  # the fused path leaves the grads unscaled
        d, d_bf16, d32 = m.master - p0, r.master - p0, r32.master - p0
        # both bf16 steps within the bf16-vs-fp32 tolerance of the fp32 step (test_muon_batch.py's RANDOM_TOL)
        assert float((d - d32).norm() / d32.norm()) <= RANDOM_TOL, m.master.shape
        assert float((d_bf16 - d32).norm() / d32.norm()) <= RANDOM_TOL, m.master.shape


@gpu
@needs_kernels
def test_blend_and_apply_read_the_verdict_on_the_device() -> None:
    """`coef` as an fp32 device scalar gives the bits of the same host float; `skip` 1 leaves the momentum
    (blend), the master and the published param (apply) unwritten, and `skip` 0 writes them as without it."""
    from trainer.kernels import muon_triton

    g, m, p = torch.randn(3, 2, 128, 256, device="cuda").unbind(0)
    o = torch.randn(2, 128, 256, device="cuda").bfloat16()
    blocks = g.numel() // muon_triton.BLOCK
    zero, one = torch.zeros((), device="cuda"), torch.ones((), device="cuda")

    def blend(coef: float | torch.Tensor, skip: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        mm, out, partials = m.clone(), torch.empty_like(o), torch.zeros(blocks, device="cuda")
        muon_triton.blend_(g, mm, out, partials, 0, coef=coef, beta=0.9, nesterov=True, skip=skip)
        return mm, out, partials

    for coef in (0.3718, 1.0):
        ref = blend(coef, None)
        for got in (blend(torch.tensor(coef, device="cuda"), None), blend(torch.tensor(coef, device="cuda"), zero)):
            assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert not torch.equal(ref[0], m) and torch.equal(blend(0.5, one)[0], m)

    def apply(skip: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        pp, q = p.clone(), p.bfloat16()
        muon_triton.apply_(pp, o, decay=0.99, alpha=-0.1, publish=q, skip=skip)
        return pp, q

    ref = apply(None)
    assert all(torch.equal(a, b) for a, b in zip(ref, apply(zero)))
    skipped = apply(one)
    assert not torch.equal(ref[0], p) and torch.equal(skipped[0], p) and torch.equal(skipped[1], p.bfloat16())


# --- row-block views: the query, key and value parts of a fused QKV weight (optimizer.muon_split_qkv) ---------
@gpu
@needs_kernels
def test_blend_and_apply_on_row_block_views_are_the_contiguous_bits() -> None:
    """The kernels on `[G, r, n]` row-block views of `[G, R, n]` tensors give, in those rows, exactly the bits
    they give on contiguous copies of the blocks, and leave every other row of the tensors untouched."""
    from trainer.kernels import muon_triton

    G, R, n = 4, 6 * 128, 256
    g, m, p = torch.randn(3, G, R, n, device="cuda").unbind(0)
    for lo, hi in ((0, 4 * 128), (4 * 128, 5 * 128), (5 * 128, R)):  # Megatron's q, k, v rows of each group
        whole_m = m.clone()
        gv, mv, pv = g[:, lo:hi], whole_m[:, lo:hi], p.clone()[:, lo:hi]
        assert not gv.is_contiguous() and muon_triton.takes(gv)
        mc, pc = mv.contiguous(), pv.contiguous()
        out_v, out_c = (torch.empty(G * (hi - lo), n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        blocks = out_v.numel() // muon_triton.BLOCK
        part_v, part_c = torch.zeros(blocks, device="cuda"), torch.zeros(blocks, device="cuda")
        muon_triton.blend_(gv, mv, out_v, part_v, 0, coef=0.37, beta=0.9, nesterov=True)
        muon_triton.blend_(gv.contiguous(), mc, out_c, part_c, 0, coef=0.37, beta=0.9, nesterov=True)
        assert torch.equal(out_v, out_c) and torch.equal(part_v, part_c) and torch.equal(mv, mc)
        others = torch.ones(R, dtype=torch.bool)
        others[lo:hi] = False
        assert torch.equal(whole_m.view(G, R, n)[:, others], m[:, others])  # the other parts' rows: untouched
        pub_c = torch.zeros_like(pc, dtype=torch.bfloat16)
        pub_whole = torch.zeros(G, R, n, dtype=torch.bfloat16, device="cuda")
        pub_v = pub_whole[:, lo:hi]
        muon_triton.apply_(pv, out_v, decay=0.99, alpha=-0.1, publish=pub_v)
        muon_triton.apply_(pc, out_c, decay=0.99, alpha=-0.1, publish=pub_c)
        assert torch.equal(pv, pc) and torch.equal(pub_v, pub_c)
        assert float(pub_whole[:, others].abs().max()) == 0.0
    with pytest.raises(ValueError, match="whole-block row-block views"):
        muon_triton.blend_(g[:, :, :128], m[:, :, :128], torch.empty(G * R, 128, dtype=torch.bfloat16, device="cuda"),
                           torch.zeros(G * R * 128 // muon_triton.BLOCK, device="cuda"), 0, coef=1.0, beta=0.9,
                           nesterov=True)  # fmt: skip


@gpu
@needs_kernels
def test_fused_qkv_step_is_the_step_of_its_parts_as_contiguous_matrices() -> None:
    """A fused QKV weight split (`qkv_matrices`, row-block views on the fused kernels) steps bitwise as its query,
    key and value parts copied out as contiguous matrices do, and within the bf16 tolerance of the fp32 step."""
    from moectl.core.facts import QkvRows
    from trainer.optim.muon import qkv_parts

    rows, n = QkvRows(4, 4 * 128, 128), 2048  # the reference model's attention: [3072, 2048]
    gen = torch.Generator().manual_seed(5)
    p, g, b = (torch.randn(rows.groups * rows.group_rows, n, generator=gen).cuda() for _ in range(3))
    hp = dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.1, grad_scale=0.5)
    split = muon_batch.qkv_matrices(p.clone(), g.clone(), b.clone(), rows)
    assert fused_elementwise(split[:1], torch.bfloat16) and fused_elementwise(split[1:], torch.bfloat16)
    parts = [MuonMatrix(*(qkv_parts(t, rows)[i].reshape(-1, n).clone() for t in (p, g, b))) for i in range(3)]
    muon_step_(split, compute_dtype=torch.bfloat16, **hp)  # type: ignore[arg-type]
    muon_step_(parts, compute_dtype=torch.bfloat16, **hp)  # type: ignore[arg-type]
    for s, c in zip(split, parts):
        assert torch.equal(s.master.reshape(-1, n), c.master) and torch.equal(s.momentum.reshape(-1, n), c.momentum)
    ref32 = muon_batch.qkv_matrices(p.clone(), g.clone(), b.clone(), rows)
    muon_step_(ref32, compute_dtype=torch.float32, **hp)  # type: ignore[arg-type]  # fp32: the torch path
    whole = torch.cat([s.master for s in split], dim=1).reshape(p.shape)
    whole32 = torch.cat([s.master for s in ref32], dim=1).reshape(p.shape)
    d, d32 = whole - p, whole32 - p
    assert float((d - d32).norm() / d32.norm()) <= RANDOM_TOL
