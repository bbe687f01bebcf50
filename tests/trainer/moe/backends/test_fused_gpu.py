"""GPU: the Triton kernels against their pure-torch reference, and the fused backend against a per-expert loop.

Marked `gpu`: skipped without CUDA (tests/conftest.py); run on the device tool. Fresh random inputs per case,
uneven and empty experts, both fc1 layouts (interleave on/off), every activation, with and without probs
and biases. Tolerances: relative error (||got - ref|| / ||ref||) under 1e-2 for bf16 operands against an
fp32 oracle computed from the same bf16 values; NaN never passes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from expert_oracle import loop_expert_mlp, oracle_grads, rel_err
from trainer.moe import expert_math
from trainer.moe.backends.fused import FusedBackend

pytestmark = pytest.mark.gpu

ACTS = ["swiglu", "quick_geglu", "squared_relu"]
COUNTS = [128, 0, 77, 1, 300, 0, 33, 61]  # uneven, unaligned, two empty experts


def _finite(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None:
            assert torch.isfinite(t).all(), "NaN or inf in a kernel output"


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("interleave", [None, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_glu_matches_reference(activation, interleave, dtype, with_bias):
    from trainer.kernels import glu_triton

    if interleave and activation == "squared_relu":
        pytest.skip("interleave applies to gated activations only")
    rows, f, experts = 1003, 384, 5  # rows not a multiple of any tile; F spans three column tiles
    h = f if activation == "squared_relu" else 2 * f
    dev = "cuda"
    h_PH = torch.randn(rows, h, device=dev).to(dtype)
    probs_P = torch.rand(rows, device=dev)
    da_PF = torch.randn(rows, f, device=dev).to(dtype)
    bias_EH = torch.randn(experts, h, device=dev).to(dtype) if with_bias else None
    expert_P = torch.randint(0, experts, (rows,), device=dev, dtype=torch.int32) if with_bias else None

    a = glu_triton.glu_forward(h_PH, probs_P, activation, interleave, bias_EH, expert_P)
    a_ref = expert_math.fused_forward(h_PH, probs_P, activation, interleave, bias_EH, expert_P)
    dh, dp, a2 = glu_triton.glu_backward(h_PH, probs_P, da_PF, activation, interleave, bias_EH, expert_P)
    dh_ref, dp_ref, a2_ref = expert_math.fused_backward(
        h_PH, probs_P, da_PF, activation, interleave, bias_EH, expert_P
    )
    _finite(a, dh, dp, a2)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert a.dtype == dtype and dh.dtype == dtype and dp.dtype == probs_P.dtype
    assert rel_err(a, a_ref) < tol
    assert rel_err(a2, a_ref) < tol
    assert rel_err(dh, dh_ref) < tol
    assert rel_err(dp, dp_ref) < tol
    assert rel_err(a2_ref, a_ref) == 0.0

    # Without probs: no dprobs, and the activation is unscaled.
    a_np = glu_triton.glu_forward(h_PH, None, activation, interleave, bias_EH, expert_P)
    assert rel_err(a_np, expert_math.fused_forward(h_PH, None, activation, interleave, bias_EH, expert_P)) < tol
    _, dp_none, _ = glu_triton.glu_backward(h_PH, None, da_PF, activation, interleave, bias_EH, expert_P)
    assert dp_none is None


def test_triton_row_bias_epilogue():
    from trainer.kernels import glu_triton

    y = torch.randn(517, 264, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(517, device="cuda")
    b2 = torch.randn(6, 264, device="cuda", dtype=torch.bfloat16)
    experts = torch.randint(0, 6, (517,), device="cuda", dtype=torch.int32)
    want = y.float() + probs[:, None] * b2.float()[experts.long()]
    got = glu_triton.add_row_bias_(y.clone(), probs, b2, experts)
    assert rel_err(got, want) < 1e-2


def _problem(activation, counts, with_bias, with_probs, dtype, d=256, f=384):
    e, t = len(counts), sum(counts)
    h = f if activation == "squared_relu" else 2 * f
    dev = "cuda"
    x = torch.randn(t, d, device=dev).to(dtype)
    w1 = (torch.randn(e, h, d, device=dev) / d**0.5).to(dtype)
    w2 = (torch.randn(e, d, f, device=dev) / f**0.5).to(dtype)
    b1 = (torch.randn(e, h, device=dev) * 0.1).to(dtype) if with_bias else None
    b2 = (torch.randn(e, d, device=dev) * 0.1).to(dtype) if with_bias else None
    probs = torch.rand(t, device=dev) + 0.05 if with_probs else None
    dy = torch.randn(t, d, device=dev).to(dtype)
    return x, w1, b1, w2, b2, probs, dy


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("interleave", [None, 64])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("overlap_wgrad", [True, False])
def test_fused_bf16_matches_loop(activation, interleave, with_bias, with_probs, overlap_wgrad):
    if interleave and activation == "squared_relu":
        pytest.skip("interleave applies to gated activations only")
    x, w1, b1, w2, b2, probs, dy = _problem(activation, COUNTS, with_bias, with_probs, torch.bfloat16)
    spec = SimpleNamespace(activation=activation, glu_interleave_size=interleave, ffn_size=w2.shape[2])
    counts_E = torch.tensor(COUNTS, device="cuda")
    backend = FusedBackend("cuda", overlap_wgrad=overlap_wgrad)
    # Poison the allocator's free blocks, so an unwritten output row would show as NaN, not as a stale zero.
    torch.full((64 << 20,), float("nan"), device="cuda")
    y, ctx = backend.forward(x, w1, b1, w2, b2, counts_E, probs, spec)
    grads = backend.backward(ctx, dy)
    y_ref, grads_ref = oracle_grads(x, w1, b1, w2, b2, COUNTS, probs, dy, activation, interleave)
    _finite(y, *grads)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, y_ref) < 1e-2
    for name, got, want in zip(["dx", "dw1", "db1", "dw2", "db2", "dprobs"], grads, grads_ref):
        if want is None:
            assert got is None, name
            continue
        assert got.shape == want.shape, name
        assert rel_err(got, want) < 1e-2, name
    for e, n in enumerate(COUNTS):
        if n == 0:  # an empty expert's weight grads are exactly zero (grouped_mm must not leave garbage)
            assert not grads[1][e].any() and not grads[3][e].any()


def test_wgrad_overlap_is_bitwise_the_same_and_stream_safe():
    """Side-stream weight grads equal one-stream ones bit for bit, also when memory is reused right after."""
    x, w1, b1, w2, b2, probs, dy = _problem("swiglu", COUNTS, False, True, torch.bfloat16)
    spec = SimpleNamespace(activation="swiglu", glu_interleave_size=None)
    counts_E = torch.tensor(COUNTS, device="cuda")
    results = []
    for overlap in (False, True, True):
        backend = FusedBackend("cuda", overlap_wgrad=overlap)
        y, ctx = backend.forward(x, w1, b1, w2, b2, counts_E, probs, spec)
        grads = backend.backward(ctx, dy)
        del ctx
        scratch = [torch.full_like(w1, float("nan")) for _ in range(3)]  # reuse freed blocks at once
        results.append([g.clone() for g in grads if g is not None])
        del scratch
    torch.cuda.synchronize()
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_fused_fp32_on_cuda_matches_loop():
    """fp32 operands take grouped_mm's non-bf16 path on CUDA; still the same function."""
    x, w1, b1, w2, b2, probs, dy = _problem("swiglu", COUNTS, True, True, torch.float32)
    spec = SimpleNamespace(activation="swiglu", glu_interleave_size=None)
    y, ctx = FusedBackend().forward(x, w1, b1, w2, b2, torch.tensor(COUNTS, device="cuda"), probs, spec)
    grads = FusedBackend().backward(ctx, dy)
    y_ref, grads_ref = oracle_grads(x, w1, b1, w2, b2, COUNTS, probs, dy, "swiglu", None)
    assert rel_err(y, y_ref) < 1e-3  # TF32-level: CUDA matmuls may run fp32 on tensor cores
    for got, want in zip(grads, grads_ref):
        assert rel_err(got, want) < 1e-3


def test_fused_matches_grouped_backend_and_runs_through_grouped_mlp():
    """The registry's `fused` on CUDA, inside GroupedMLP (both layouts), against `grouped`, bf16."""
    from moectl.core.config.schema import MoEConfig
    from trainer.moe.experts import GroupedMLP

    outs = {}
    for backend in ("fused", "grouped"):
        for grouped_weight in (True, False):
            cfg = MoEConfig(
                num_experts=4, ffn_hidden_size=128, backend=backend, glu_interleave_size=32,
                add_bias=True, single_grouped_weight=grouped_weight,
            )  # fmt: skip
            mlp = GroupedMLP(cfg, 64, params_dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
            mlp = mlp.cuda()
            g = torch.Generator(device="cuda").manual_seed(1)
            x = torch.randn(100, 64, device="cuda", generator=g).bfloat16().requires_grad_()
            probs = torch.rand(100, device="cuda", generator=g).requires_grad_()
            y = mlp(x, torch.tensor([40, 0, 35, 25], device="cuda"), probs)
            y.backward(torch.randn(100, 64, device="cuda", generator=g).bfloat16())
            outs[backend, grouped_weight] = [y.detach(), x.grad, probs.grad] + [
                p.grad for p in mlp.parameters()
            ]
    for grouped_weight in (True, False):
        for got, want in zip(outs["fused", grouped_weight], outs["grouped", grouped_weight]):
            _finite(got)
            assert rel_err(got, want) < 1e-2
    for a, b in zip(outs["fused", True][:3], outs["fused", False][:3]):
        assert torch.equal(a, b)  # layouts share kernels: bitwise identical
