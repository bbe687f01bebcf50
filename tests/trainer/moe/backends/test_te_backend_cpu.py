"""The `te` backend on CPU: its plumbing over a pure-torch stand-in for TE (tests/fake_te.py), its registry
and import paths without TE, and the fc1 layout conversion it does for TE's kernels.

The stand-in computes what TE's grouped GEMM and scaled activation kernels compute (as read from TE 2.20.2's
source), so `te` must match `fused` (both on their CPU paths, fp32) to float rounding: forward and every
grad, all activations, interleave off / native (32) / converted (8), uneven and empty experts, biases and
probs on and off, main_grad accumulation, delayed wgrad, and fp8 tensorwise (emulated on both sides).
That TE really does what the stand-in says is test_te_backend_gpu.py's job.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

from expert_oracle import deinterleave_index, random_problem, rel_err
from fake_te import fake_te
from moectl.core.config.schema import MoEConfig
from moectl.core.errors import MoectlError
from trainer.main_grad import attach_main_grads
from trainer.moe import backends as eb
from trainer.moe.backends import get_backend, supports_delayed_wgrad, supports_precision, supports_wgrad_into
from trainer.moe.backends import te_activation, te_runtime
from trainer.moe.backends.fused import FusedBackend
from trainer.moe.backends.te import TEBackend, host_splits
from trainer.moe.expert_precision import ExpertPrecision
from trainer.moe.experts import GroupedMLP
from trainer.precision import DelayedRecipe, TensorwiseRecipe

pytestmark = pytest.mark.usefixtures("one_thread")

ACTS = ["swiglu", "quick_geglu", "squared_relu"]
COUNTS = [5, 0, 11, 3, 0, 9]  # uneven, with empty experts (one in the middle, one before the last)
D, F = 16, 64  # F = 64: interleave 32 (TE reads it natively) and 8 (converted to halves first) both divide it


def _spec(activation, interleave):
    return SimpleNamespace(activation=activation, glu_interleave_size=interleave, ffn_size=F)


def _assert_close(got, want, tol, names=("y", "dx", "dw1", "db1", "dw2", "db2", "dprobs")):
    for name, a, b in zip(names, got, want):
        if b is None:
            assert a is None, name
            continue
        assert a is not None and a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) < tol, (name, rel_err(a, b))


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("interleave", [None, 32, 8])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_probs", [True, False])
def test_te_matches_fused(activation, interleave, with_bias, with_probs):
    if interleave and activation == "squared_relu":
        pytest.skip("interleave applies to gated activations only")
    seed = ACTS.index(activation) * 100 + (interleave or 0) + 2 * with_bias + with_probs
    x, w1, b1, w2, b2, probs, dy = random_problem(activation, COUNTS, with_bias, with_probs, seed, d=D, f=F)
    spec = _spec(activation, interleave)
    counts = torch.tensor(COUNTS)
    y, ctx = TEBackend("cpu", te=fake_te()).forward(x, w1, b1, w2, b2, counts, probs, spec)
    grads = TEBackend("cpu", te=fake_te()).backward(ctx, dy)
    y_ref, ctx_ref = FusedBackend("cpu").forward(x, w1, b1, w2, b2, counts, probs, spec)
    grads_ref = FusedBackend("cpu").backward(ctx_ref, dy)
    _assert_close((y, *grads), (y_ref, *grads_ref), 1e-5)
    for e, n in enumerate(COUNTS):
        if n == 0:  # an empty expert's weight grads are exactly zero
            assert not grads[1][e].any() and not grads[3][e].any()


def test_delayed_wgrad_and_main_grad_accumulation_are_the_plain_backward():
    x, w1, b1, w2, b2, probs, dy = random_problem("swiglu", COUNTS, True, True, 7, d=D, f=F)
    spec, counts = _spec("swiglu", 32), torch.tensor(COUNTS)
    backend = TEBackend("cpu", te=fake_te())
    assert supports_delayed_wgrad(backend) and supports_wgrad_into(backend) and supports_precision(backend)
    plain = backend.backward(backend.forward(x, w1, b1, w2, b2, counts, probs, spec)[1], dy)
    dx, dprobs, wgrad = backend.backward_dgrad(backend.forward(x, w1, b1, w2, b2, counts, probs, spec)[1], dy)
    dw1, db1, dw2, db2 = wgrad()
    for a, b in zip((dx, dw1, db1, dw2, db2, dprobs), (plain[0], *plain[1:5], plain[5])):
        assert torch.equal(a, b)
    # main_grad: per-expert fp32 targets that already hold something; the wgrad GEMMs add into them.
    start1, start2 = torch.randn_like(w1), torch.randn_like(w2)
    into = (list(start1.clone().unbind(0)), list(start2.clone().unbind(0)))
    got = backend.backward(backend.forward(x, w1, b1, w2, b2, counts, probs, spec)[1], dy, wgrad_into=into)
    assert got[1] is None and got[3] is None
    assert rel_err(torch.stack(into[0]), start1 + plain[1]) < 1e-6
    assert rel_err(torch.stack(into[1]), start2 + plain[3]) < 1e-6
    assert torch.equal(torch.stack(into[0])[1], start1[1])  # the empty expert's main_grad is left alone
    for a, b in zip((got[0], got[2], got[4], got[5]), (plain[0], plain[2], plain[4], plain[5])):
        assert torch.equal(a, b)


def test_no_rows_at_all():
    x, w1, b1, w2, b2, probs, dy = random_problem("swiglu", [0, 0, 0], True, True, 3, d=D, f=F)
    backend = TEBackend("cpu", te=fake_te())
    y, ctx = backend.forward(x, w1, b1, w2, b2, torch.zeros(3, dtype=torch.long), probs, _spec("swiglu", None))
    dx, dw1, db1, dw2, db2, dprobs = backend.backward(ctx, dy)
    assert y.shape == (0, D) and dx.shape == (0, D) and dprobs.shape == (0,)
    assert not dw1.any() and not dw2.any() and not db1.any() and not db2.any()


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("interleave", [None, 8])
def test_fp8_tensorwise_matches_fused(fmt, interleave):
    """Per-expert current scaling on both sides (fused: moectl's emulated recipe; te: the stand-in's TE
    quantizers). Tiny upstream differences (where b1 is rounded) flip some fp8 roundings, most under hybrid's
    e5m2 grads, so: te within 5% of fused, and no further from the fp32 result than fused is (+10%)."""
    recipe = TensorwiseRecipe(fmt)
    a = recipe.align_size
    counts = [2 * a, 0, a, 3 * a]
    x, w1, b1, w2, b2, probs, dy = random_problem("swiglu", counts, True, True, 11, d=D, f=F)
    spec, counts_t = _spec("swiglu", interleave), torch.tensor(counts)
    backend = TEBackend("cpu", te=fake_te())
    y, ctx = backend.forward(x, w1, b1, w2, b2, counts_t, probs, spec, precision=ExpertPrecision(recipe))
    grads = backend.backward(ctx, dy)
    y_ref, ctx_ref = FusedBackend("cpu").forward(
        x, w1, b1, w2, b2, counts_t, probs, spec, precision=ExpertPrecision(TensorwiseRecipe(fmt))
    )  # fmt: skip
    grads_ref = FusedBackend("cpu").backward(ctx_ref, dy)
    hp = FusedBackend("cpu").backward(FusedBackend("cpu").forward(x, w1, b1, w2, b2, counts_t, probs, spec)[1], dy)
    assert grads[1].dtype == torch.float32 and grads[3].dtype == torch.float32  # a recipe's weight grads
    _assert_close((y, *grads), (y_ref, *grads_ref), 5e-2)
    for got, ref, exact in zip(grads, grads_ref, hp):
        assert rel_err(got, exact) <= 1.1 * rel_err(ref, exact) + 1e-3
    assert not grads[1][1].any() and not grads[3][1].any()
    with pytest.raises(ValueError, match="wgrad_into is for the high-precision path"):
        backend.backward(backend.forward(x, w1, b1, w2, b2, counts_t, probs, spec, precision=ExpertPrecision(recipe))[1],
                         dy, wgrad_into=([], []))  # fmt: skip


def test_fp8_refusals():
    x, w1, b1, w2, b2, probs, _ = random_problem("swiglu", [16, 16], False, True, 5, d=D, f=F)
    backend, spec = TEBackend("cpu", te=fake_te()), _spec("swiglu", None)
    with pytest.raises(MoectlError, match="tensorwise"):
        backend.forward(x, w1, b1, w2, b2, torch.tensor([16, 16]), probs, spec, precision=ExpertPrecision(DelayedRecipe()))
    given = ExpertPrecision(TensorwiseRecipe(), quantized_weights={"fc1": object(), "fc2": None})  # type: ignore[dict-item]
    with pytest.raises(MoectlError, match="param gather"):
        backend.forward(x, w1, b1, w2, b2, torch.tensor([16, 16]), probs, spec, precision=given)
    x2, w1, b1, w2, b2, probs2, _ = random_problem("swiglu", [8, 24], False, True, 5, d=D, f=F)
    with pytest.raises(ValueError, match="multiple of 16"):
        backend.forward(x2, w1, b1, w2, b2, torch.tensor([8, 24]), probs2, spec, precision=ExpertPrecision(TensorwiseRecipe()))


def test_host_splits_are_checked():
    assert host_splits(torch.tensor([2, 0, 3]), 5) == [2, 0, 3]
    with pytest.raises(ValueError, match="sum to the rows"):
        host_splits(torch.tensor([2, 0, 3]), 6)


@pytest.mark.parametrize("grouped", [True, False], ids=["single_grouped", "per_expert"])
@pytest.mark.parametrize("fuse", [False, True], ids=["autograd", "main_grad"])
@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed_wgrad"])
def test_through_grouped_mlp_both_layouts(monkeypatch, grouped, fuse, delay):
    """GroupedMLP with backend te (the stand-in) against backend fused: layouts, main_grad, delayed wgrad."""
    monkeypatch.setitem(eb._REGISTRY, "te", lambda device: TEBackend(device, te=fake_te()))
    out = {}
    for backend in ("te", "fused"):
        cfg = MoEConfig(
            num_experts=4, ffn_hidden_size=F, backend=backend, glu_interleave_size=32, add_bias=True,
            single_grouped_weight=grouped, single_grouped_bias=grouped,
        )  # fmt: skip
        mlp = GroupedMLP(cfg, D, generator=torch.Generator().manual_seed(0), gradient_accumulation_fusion=fuse,
                         delay_wgrad=delay)  # fmt: skip
        if fuse:
            attach_main_grads(mlp)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(30, D, generator=g).requires_grad_()
        probs = torch.rand(30, generator=g).requires_grad_()
        y = mlp(x, torch.tensor([10, 0, 15, 5]), probs)
        y.backward(torch.randn(30, D, generator=g))
        if delay:
            mlp.delayed.flush()
        grads = [p.main_grad if fuse else p.grad for p in mlp.parameters()]
        out[backend] = [y.detach(), x.grad, probs.grad, *grads]
    for a, b in zip(out["te"], out["fused"]):
        assert a is not None and rel_err(a, b) < 1e-5


def test_fc1_halves_conversion_is_the_oracle_permutation():
    h = torch.randn(5, 2 * 48)
    for interleave in (8, 16, 24):
        halves = te_activation.to_halves(h, interleave)
        assert torch.equal(halves, h[:, deinterleave_index(96, interleave)])
        assert torch.equal(te_activation.from_halves(halves, interleave), h)
    assert te_activation.native_interleave(64) == 64 and te_activation.native_interleave(8) == 0
    assert te_activation.native_interleave(None) == 0


def test_registry_refuses_te_on_cpu_without_importing_it():
    with pytest.raises(MoectlError, match="CUDA kernels") as info:
        get_backend("te", "cpu")
    assert "moe.backend: auto" in info.value.fix
    assert "transformer_engine" not in sys.modules or _te_importable()


def test_importing_the_backends_never_imports_te():
    code = (
        "import sys\n"
        "import trainer.moe.backends, trainer.moe.backends.te, trainer.moe.experts\n"
        "assert 'transformer_engine' not in sys.modules, 'TE imported at package import'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def _te_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(_te_importable(), reason="TE is installed here")
def test_load_te_without_te_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(te_runtime, "_LOADED", None)
    with pytest.raises(MoectlError, match="could not import Transformer Engine") as info:
        te_runtime.load_te()
    assert "te_setup.md" in info.value.fix


def test_version_pin():
    with pytest.raises(MoectlError, match=">= 2.20; found 2.19.0"):
        te_runtime.check_version("2.19.0")
    with pytest.raises(MoectlError, match="found unknown"):
        te_runtime.check_version("unknown")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        te_runtime.check_version("2.20.2")
        te_runtime.check_version("2.20.0.dev0+abc")
    with pytest.warns(UserWarning, match="written against Transformer Engine 2.20.2; found 2.21.0"):
        te_runtime.check_version("2.21.0")


def test_banner_line_says_which_gemms_te_runs():
    line = te_runtime.describe("tensorwise", "swiglu")
    assert "general_grouped_gemm in fp8" in line and "tex.scaled_swiglu" in line
    assert "in the model dtype" in te_runtime.describe(None, "quick_geglu")
    assert "tex.scaled_clamped_swiglu" in te_runtime.describe(None, "quick_geglu")


@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed_wgrad"])
def test_fp8_with_main_grad_fusion_routes_te_grads(monkeypatch, delay):
    """Under a recipe the te backend adds no weight grads itself: GroupedMLP must route them (the fused backend
    alone takes `wgrad_into` under a recipe). A review caught the te backend being handed `wgrad_into` there."""
    monkeypatch.setitem(eb._REGISTRY, "te", lambda device: TEBackend(device, te=fake_te()))
    assert not eb.supports_recipe_wgrad_into(TEBackend("cpu", te=fake_te()))
    assert eb.supports_recipe_wgrad_into(FusedBackend("cpu"))
    recipe = TensorwiseRecipe()
    counts = [2 * recipe.align_size, 0, recipe.align_size, 3 * recipe.align_size]
    cfg = MoEConfig(num_experts=4, ffn_hidden_size=F, backend="te", glu_interleave_size=32)
    mlp = GroupedMLP(cfg, D, generator=torch.Generator().manual_seed(0), gradient_accumulation_fusion=True,
                     recipe=recipe, delay_wgrad=delay)  # fmt: skip
    attach_main_grads(mlp)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), D, generator=g).requires_grad_()
    mlp(x, torch.tensor(counts), None).backward(torch.randn(sum(counts), D, generator=g))
    if delay:
        mlp.delayed.flush()
    for p in mlp.linear_fc1.weight_params() + mlp.linear_fc2.weight_params():
        assert p.grad is None and p.main_grad.abs().sum() > 0
