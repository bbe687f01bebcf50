"""Expert backends against each other and against a naive per-row formula; the interleaved fc1 layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moectl.core.config.schema import MoEConfig
from moectl.core.errors import MoectlError
from trainer.moe import ExpertSpec, GroupedMLP, get_backend
from ckpt.layout import reinterleave_fc1
from trainer.moe import backends as eb
from trainer.moe.expert_math import gate_up_views

E, D, FF = 4, 8, 8
COUNTS = [3, 0, 6, 2]
CASES = [
    (act, bias, interleave)
    for act in ("swiglu", "quick_geglu", "squared_relu")
    for bias in (False, True)
    for interleave in ((None, 2) if act != "squared_relu" else (None,))
]


def tensors(act: str, bias: bool, seed: int = 0) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    H = 2 * FF if act != "squared_relu" else FF
    T = sum(COUNTS)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "x": r(T, D), "w1": r(E, H, D) * 0.4, "b1": r(E, H) * 0.2 if bias else None, "w2": r(E, D, FF) * 0.4,
        "b2": r(E, D) * 0.2 if bias else None, "probs": torch.rand(T, generator=g), "dy": r(T, D),
    }  # fmt: skip


def run_backend(name: str, t: dict, spec: ExpertSpec) -> list[torch.Tensor | None]:
    backend = get_backend(name, "cpu")
    y, ctx = backend.forward(t["x"], t["w1"], t["b1"], t["w2"], t["b2"], torch.tensor(COUNTS), t["probs"], spec)
    return [y, *backend.backward(ctx, t["dy"])]


def naive(t: dict, spec: ExpertSpec) -> list[torch.Tensor | None]:
    """Row by row with plain autograd and the contiguous [gate; up] layout: the definition, nothing shared."""
    leaves = {k: (v.clone().requires_grad_() if v is not None and k != "dy" else v) for k, v in t.items()}
    w1, b1 = leaves["w1"], leaves["b1"]
    if spec.glu_interleave_size:  # undo the storage layout by hand: block b, half h, offset o
        I, Fn = spec.glu_interleave_size, spec.ffn_size
        rows = [b * 2 * I + h * I + o for h in range(2) for b in range(Fn // I) for o in range(I)]
        w1, b1 = w1[:, rows], (b1[:, rows] if b1 is not None else None)
    experts = [e for e, n in enumerate(COUNTS) for _ in range(n)]
    ys = []
    for i, e in enumerate(experts):
        h = w1[e] @ leaves["x"][i] + (b1[e] if b1 is not None else 0)
        if spec.activation == "squared_relu":
            a = F.relu(h) ** 2
        else:
            gate, up = h[: spec.ffn_size], h[spec.ffn_size :]
            a = (gate * torch.sigmoid(gate if spec.activation == "swiglu" else 1.702 * gate)) * up
        z = leaves["w2"][e] @ a + (leaves["b2"][e] if leaves["b2"] is not None else 0)
        ys.append(leaves["probs"][i] * z)
    y = torch.stack(ys)
    y.backward(t["dy"])
    g = lambda k: None if leaves[k] is None else leaves[k].grad  # noqa: E731
    return [y.detach(), g("x"), g("w1"), g("b1"), g("w2"), g("b2"), g("probs")]


NAMES = ["y", "dx", "dw1", "db1", "dw2", "db2", "dprobs"]


def assert_close(got, ref, rel: float) -> None:
    for name, a, b in zip(NAMES, got, ref):
        assert (a is None) == (b is None), name
        if a is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        err = (a - b).norm() / b.norm().clamp_min(1e-30)
        assert err < rel, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("act,bias,interleave", CASES)
def test_grouped_matches_loop_and_loop_matches_the_definition(act, bias, interleave):
    spec = ExpertSpec(act, FF, interleave)
    t = tensors(act, bias)
    loop = run_backend("loop", t, spec)
    assert_close(loop, naive(t, spec), rel=1e-6)
    assert_close(run_backend("grouped", t, spec), loop, rel=1e-5)
    # the empty expert gets exact zero weight grads from both
    for got in (loop, run_backend("grouped", t, spec)):
        assert not got[2][1].any() and not got[4][1].any()


def test_backends_accept_no_probs_and_a_broadcast_grad():
    """probs=None means no scaling (dprobs None); an expanded dy (from y.sum()) must not trip _grouped_mm."""
    spec = ExpertSpec("swiglu", FF)
    t = tensors("swiglu", False)
    t["probs"] = None
    t["dy"] = torch.ones(1, 1).expand(sum(COUNTS), D)
    loop, grouped = run_backend("loop", t, spec), run_backend("grouped", t, spec)
    assert loop[-1] is None and grouped[-1] is None
    assert_close(grouped, loop, rel=1e-5)


def test_megatron_interleave_example():
    """Megatron's example: rows [1,2,5,6,3,4,7,8] with I=2 de-interleave to 1..8 (gate 1..4, up 5..8)."""
    contiguous = torch.arange(1.0, 9.0)[:, None]
    interleaved = torch.tensor([1.0, 2, 5, 6, 3, 4, 7, 8])[:, None]
    assert torch.equal(reinterleave_fc1(contiguous, None, 2, 4, dim=0), interleaved)
    assert torch.equal(reinterleave_fc1(interleaved, 2, None, 4, dim=0), contiguous)
    gate, up = (v.reshape(1, -1) for v in gate_up_views(interleaved.t(), 2))
    assert gate.tolist() == [[1, 2, 3, 4]] and up.tolist() == [[5, 6, 7, 8]]
    joined = torch.empty(1, 8)
    for view, half in zip(gate_up_views(joined, 2), (gate, up)):
        view.copy_(half.reshape(view.shape))
    assert torch.equal(joined, interleaved.t())


@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_interleaved_layout_is_a_row_permutation_of_the_contiguous_one(backend):
    """Same module math with fc1 rows stored interleaved: outputs match, grads are the permuted grads."""
    I = 4
    base = dict(num_experts=E, ffn_hidden_size=FF, add_bias=True, single_grouped_bias=True, backend=backend)
    contig = GroupedMLP(MoEConfig(**base), D, init_std=0.3, generator=torch.Generator().manual_seed(1))
    inter = GroupedMLP(MoEConfig(**base, glu_interleave_size=I), D, init_std=0.3)
    with torch.no_grad():
        contig.linear_fc1.bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
        inter.linear_fc1.weight.copy_(reinterleave_fc1(contig.linear_fc1.weight, None, I, FF, dim=-2))
        inter.linear_fc1.bias.copy_(reinterleave_fc1(contig.linear_fc1.bias, None, I, FF, dim=-1))
        inter.linear_fc2.weight.copy_(contig.linear_fc2.weight)
    assert not torch.equal(inter.linear_fc1.weight, contig.linear_fc1.weight)
    g = torch.Generator().manual_seed(3)
    T = sum(COUNTS)
    x, probs, dy = torch.randn(T, D, generator=g), torch.rand(T, generator=g), torch.randn(T, D, generator=g)
    outs = []
    for mlp in (contig, inter):
        xi = x.clone().requires_grad_()
        y = mlp(xi, torch.tensor(COUNTS), probs)
        y.backward(dy)
        outs.append((y, xi.grad, mlp.linear_fc1.weight.grad, mlp.linear_fc1.bias.grad, mlp.linear_fc2.weight.grad))
    (y0, dx0, dw10, db10, dw20), (y1, dx1, dw11, db11, dw21) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx1, dx0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(reinterleave_fc1(dw11, I, None, FF, dim=-2), dw10, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(reinterleave_fc1(db11, I, None, FF, dim=-1), db10, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw21, dw20, rtol=1e-6, atol=1e-6)


def test_backend_registry_and_errors():
    assert get_backend("auto", "cpu").name == "grouped"
    assert get_backend("loop", torch.device("cpu")).name == "loop"
    with pytest.raises(MoectlError, match="not available"):
        get_backend("no_such_backend", "cpu")
    with pytest.raises(MoectlError, match="CUDA kernels"):  # te: Transformer Engine's kernels, CUDA only
        get_backend("te", "cpu")
    eb.register_backend("missing", "trainer.kernels.no_such_backend_module:Backend")
    try:
        with pytest.raises(MoectlError, match="not in this build"):
            get_backend("missing", "cpu")
    finally:
        del eb._REGISTRY["missing"]


def test_grouped_backend_rejects_unaligned_sizes_with_a_fix():
    spec = ExpertSpec("swiglu", 6)
    x, w1, w2 = torch.randn(4, 8), torch.randn(2, 12, 8), torch.randn(2, 8, 6)
    with pytest.raises(MoectlError, match="multiples of 4") as info:
        get_backend("grouped").forward(x, w1, None, w2, None, torch.tensor([2, 2]), None, spec)
    assert "moe.backend: loop" in info.value.fix


def test_spec_validation():
    with pytest.raises(MoectlError, match="gated"):
        ExpertSpec("squared_relu", 8, 4)
    with pytest.raises(MoectlError, match="divide"):
        ExpertSpec("swiglu", 8, 3)
    with pytest.raises(MoectlError, match="unknown"):
        ExpertSpec("gelu", 8)
    assert ExpertSpec("swiglu", 8).fc1_out == 16 and ExpertSpec("squared_relu", 8).fc1_out == 8
