"""FusedBackend on CPU (grouped GEMMs + the pure-torch activation) against a per-expert autograd loop, fp32."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from expert_oracle import loop_expert_mlp, random_problem, rel_err
from moectl.core.config.schema import MoEConfig
from moectl.core.errors import MoectlError
from trainer.moe.backends.fused import FusedBackend

ACTS = ["swiglu", "quick_geglu", "squared_relu"]
COUNTS = [5, 0, 11, 3, 0, 9]  # uneven, with empty experts (one in the middle, one before the last)


def _loop_grads(x, w1, b1, w2, b2, counts, probs, dy, activation, interleave):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, w1, b1, w2, b2, probs)]
    y = loop_expert_mlp(*leaves[:5], counts, leaves[5], activation, interleave)
    live = [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(y, live, dy, allow_unused=True))
    grads = []
    for t in leaves:
        if t is None:
            grads.append(None)
            continue
        g = next(got)
        grads.append(torch.zeros_like(t) if g is None else g)
    return y.detach(), grads


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("interleave", [None, 4])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_probs", [True, False])
def test_fused_matches_per_expert_loop(activation, interleave, with_bias, with_probs):
    if interleave and activation == "squared_relu":
        pytest.skip("interleave applies to gated activations only")
    seed = ACTS.index(activation) * 100 + (interleave or 0) * 10 + 2 * with_bias + with_probs
    x, w1, b1, w2, b2, probs, dy = random_problem(activation, COUNTS, with_bias, with_probs, seed)
    spec = SimpleNamespace(activation=activation, glu_interleave_size=interleave, ffn_size=w2.shape[2])
    backend = FusedBackend("cpu")
    y, ctx = backend.forward(x, w1, b1, w2, b2, torch.tensor(COUNTS), probs, spec)
    grads = backend.backward(ctx, dy)

    y_ref, grads_ref = _loop_grads(x, w1, b1, w2, b2, COUNTS, probs, dy, activation, interleave)
    assert rel_err(y, y_ref) < 1e-5
    names = ["dx", "dw1", "db1", "dw2", "db2", "dprobs"]
    for name, got, want in zip(names, grads, grads_ref):
        if want is None:
            assert got is None, name
            continue
        assert got is not None and got.shape == want.shape, name
        assert rel_err(got, want) < 1e-5, name
    # Empty experts own no rows: their weight grads are exactly zero.
    for e in (1, 4):
        assert not grads[1][e].any() and not grads[3][e].any()


def test_no_rows_at_all():
    x, w1, b1, w2, b2, probs, dy = random_problem("swiglu", [0, 0, 0], True, True, seed=7)
    spec = SimpleNamespace(activation="swiglu", glu_interleave_size=None)
    y, ctx = FusedBackend().forward(x, w1, b1, w2, b2, torch.tensor([0, 0, 0]), probs, spec)
    assert y.shape == (0, 16)
    dx, dw1, db1, dw2, db2, dprobs = FusedBackend().backward(ctx, dy)
    assert dx.shape == (0, 16) and dprobs.shape == (0,)
    for g in (dw1, db1, dw2, db2):
        assert not g.any()


def test_no_rows_with_wgrad_targets_adds_nothing_and_returns_no_weight_grads():
    # A grad returned beside wgrad_into would be routed into main_grad again after the targets were
    # reported: "a param reported its grad twice" on an expert-parallel rank that received no rows.
    x, w1, b1, w2, b2, probs, dy = random_problem("swiglu", [0, 0, 0], True, True, seed=7)
    spec = SimpleNamespace(activation="swiglu", glu_interleave_size=None)
    _, ctx = FusedBackend().forward(x, w1, b1, w2, b2, torch.tensor([0, 0, 0]), probs, spec)
    into = (list(torch.full_like(w1, 2.0).unbind(0)), list(torch.full_like(w2, float("nan")).unbind(0)))
    stale = (None, [torch.ones(1, dtype=torch.int32)] * 3)  # fc2's grads hold a skipped step's leftovers
    _, dw1, db1, dw2, db2, _ = FusedBackend().backward(ctx, dy, wgrad_into=into, wgrad_stale=stale)
    assert dw1 is None and dw2 is None and not db1.any() and not db2.any()
    assert all(torch.equal(t, torch.full_like(t, 2.0)) for t in into[0])  # fresh: untouched
    assert all(not t.any() for t in into[1]) and int(stale[1][0]) == 0  # stale: zeros, flag cleared


def test_expanded_grad_is_accepted():
    """autograd hands a stride-0 grad for y.sum(); torch._grouped_mm would reject it as is."""
    counts = [3, 4, 5]
    x, w1, b1, w2, b2, probs, _ = random_problem("swiglu", counts, False, True, seed=3)
    spec = SimpleNamespace(activation="swiglu", glu_interleave_size=None)
    y, ctx = FusedBackend().forward(x, w1, b1, w2, b2, torch.tensor(counts), probs, spec)
    dy = torch.ones(1, 1).expand_as(y)
    grads = FusedBackend().backward(ctx, dy)
    _, grads_ref = _loop_grads(x, w1, b1, w2, b2, counts, probs, dy.contiguous(), "swiglu", None)
    for got, want in zip(grads, grads_ref):
        if want is not None:
            assert rel_err(got, want) < 1e-5


def test_counts_must_cover_every_row_and_sizes_must_align():
    x, w1, b1, w2, b2, probs, _ = random_problem("swiglu", [4, 4], False, False, seed=1)
    spec = SimpleNamespace(activation="swiglu", glu_interleave_size=None)
    with pytest.raises(ValueError, match="must equal the rows of x"):
        FusedBackend().forward(x, w1, b1, w2, b2, torch.tensor([4, 3]), probs, spec)
    x, w1, b1, w2, b2, probs, _ = random_problem("swiglu", [4, 4], False, False, seed=1, d=10, f=24)
    with pytest.raises(MoectlError, match="multiples of 4"):
        FusedBackend().forward(x, w1, b1, w2, b2, torch.tensor([4, 4]), probs, spec)


def test_registry_builds_fused_and_the_cpu_path_never_imports_triton():
    """`moe.backend: fused` resolves to this backend; on CPU it must not touch the Triton module."""
    code = (
        "import sys, torch\n"
        "from trainer.moe.backends import get_backend\n"
        "from trainer.moe.expert_math import ExpertSpec\n"
        "b = get_backend('fused', 'cpu')\n"
        "assert type(b).__name__ == 'FusedBackend' and b.name == 'fused'\n"
        "x = torch.randn(6, 8); w1 = torch.randn(2, 16, 8); w2 = torch.randn(2, 8, 8)\n"
        "y, ctx = b.forward(x, w1, None, w2, None, torch.tensor([2, 4]), None, ExpertSpec('swiglu', 8))\n"
        "b.backward(ctx, torch.randn_like(y))\n"
        "assert 'trainer.kernels.glu_triton' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _train(backend: str, steps: int = 4) -> tuple[list[float], list[torch.Tensor]]:
    from trainer.moe.experts import GroupedMLP

    cfg = MoEConfig(num_experts=4, ffn_hidden_size=24, activation="swiglu", add_bias=True, backend=backend)
    torch.manual_seed(0)
    mlp = GroupedMLP(cfg, 16, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([7, 0, 12, 5])
    losses = []
    for _ in range(steps):
        x = torch.randn(24, 16, generator=g)
        probs = torch.rand(24, generator=g)
        target = torch.randn(24, 16, generator=g)
        loss = ((mlp(x, counts, probs) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in mlp.parameters()]


def test_short_training_run_fused_equals_grouped():
    losses_f, params_f = _train("fused")
    losses_g, params_g = _train("grouped")
    for a, b in zip(losses_f, losses_g):
        assert abs(a - b) <= 1e-5 * abs(b)
    for a, b in zip(params_f, params_g):
        assert rel_err(a, b) < 1e-5
    assert losses_f[-1] < losses_f[0]  # it trains, so the comparison covers real updates
