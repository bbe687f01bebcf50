"""Single grouped `[E, out, in]` params vs per-expert `weight0..`: bitwise equal outputs and every gradient.

Both layouts feed the same backend the same values (the per-expert layout stacks its weights), so anything
short of torch.equal is a bug: a disconnected parameter, a wrong slice, a grad routed to the wrong expert.
"""

from __future__ import annotations

import pytest
import torch

from moectl.core.config.schema import MoEConfig
from trainer.main_grad import attach_main_grads
from trainer.moe import GroupedMLP

E, D, F = 4, 8, 8
COUNTS = [5, 0, 3, 4]  # expert 1 gets no rows: its grads must still be exact zeros in both layouts

CASES = [
    (act, bias, interleave)
    for act in ("swiglu", "quick_geglu", "squared_relu")
    for bias in (False, True)
    for interleave in ((None, 4) if act != "squared_relu" else (None,))
]


def build(backend: str, act: str, bias: bool, interleave: int | None, grouped: bool, fuse: bool) -> GroupedMLP:
    cfg = MoEConfig(
        num_experts=E, ffn_hidden_size=F, activation=act, add_bias=bias, glu_interleave_size=interleave,
        single_grouped_weight=grouped, single_grouped_bias=grouped, backend=backend,
    )  # fmt: skip
    mlp = GroupedMLP(
        cfg, D, init_std=0.3, generator=torch.Generator().manual_seed(7), gradient_accumulation_fusion=fuse
    )
    if bias:  # biases start at zero; make them matter, identically in both layouts
        g = torch.Generator().manual_seed(8)
        with torch.no_grad():
            for lin in (mlp.linear_fc1, mlp.linear_fc2):
                b_EO = torch.randn(E, lin.bias_params()[0].shape[-1], generator=g) * 0.1
                for p, v in zip(lin.bias_params(), [b_EO] if grouped else b_EO.unbind(0)):
                    p.copy_(v)
    return mlp


def stacked(params: list[torch.Tensor]) -> torch.Tensor:
    return params[0] if len(params) == 1 else torch.stack(params)


def run(mlp: GroupedMLP, fuse: bool, steps: int = 1) -> dict[str, torch.Tensor]:
    """Outputs and grads after `steps` identical forward/backward passes, keyed by role (layout-free)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(sum(COUNTS), D, generator=g).requires_grad_()
    probs = torch.rand(sum(COUNTS), generator=g).requires_grad_()
    dy = torch.randn(sum(COUNTS), D, generator=g)
    counts = torch.tensor(COUNTS)
    if fuse:
        attach_main_grads(mlp)
    for _ in range(steps):
        y = mlp(x, counts, probs)
        y.backward(dy)
    out = {"y": y.detach(), "dx": x.grad, "dprobs": probs.grad}
    for name, lin in (("fc1", mlp.linear_fc1), ("fc2", mlp.linear_fc2)):
        for role, params in (("w", lin.weight_params()), ("b", lin.bias_params())):
            if not params:
                continue
            if fuse:
                assert all(p.grad is None for p in params), "fused wgrads must leave .grad unused"
                out[f"{name}.{role}"] = stacked([p.main_grad for p in params])
            else:
                out[f"{name}.{role}"] = stacked([p.grad for p in params])
            out[f"{name}.{role}.value"] = stacked([p.detach() for p in params])
    return out


@pytest.mark.parametrize("fuse", [False, True], ids=["autograd", "main_grad"])
@pytest.mark.parametrize("act,bias,interleave", CASES)
@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_single_grouped_equals_per_expert_bitwise(backend, act, bias, interleave, fuse):
    grouped = run(build(backend, act, bias, interleave, grouped=True, fuse=fuse), fuse)
    per_expert = run(build(backend, act, bias, interleave, grouped=False, fuse=fuse), fuse)
    assert grouped.keys() == per_expert.keys()
    expected = {"y", "dx", "dprobs", "fc1.w", "fc2.w"} | ({"fc1.b", "fc2.b"} if bias else set())
    assert expected <= grouped.keys()
    for key in grouped:
        assert torch.equal(grouped[key], per_expert[key]), key
    # the parent grouped params really receive gradient (forward-only parity misses disconnected params)
    for key in ("fc1.w", "fc2.w"):
        assert grouped[key][0].abs().sum() > 0 and grouped[key][2].abs().sum() > 0, key
        assert torch.equal(grouped[key][1], torch.zeros_like(grouped[key][1])), f"{key}: empty expert"


def attach_bare_main_grads(mlp: GroupedMLP, calls: dict[int, int]) -> None:
    """fp32 main_grads and a counting ready hook, without attach_main_grads' fold hook."""
    for p in mlp.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        p.moectl_grad_ready_hook = lambda q: calls.__setitem__(id(q), calls.get(id(q), 0) + 1)


@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_main_grad_accumulates_across_micro_batches_and_reports_ready_once(backend):
    plain = run(build(backend, "swiglu", True, None, grouped=True, fuse=False), fuse=False)
    for grouped in (True, False):
        mlp = build(backend, "swiglu", True, None, grouped=grouped, fuse=True)
        calls: dict[int, int] = {}
        attach_bare_main_grads(mlp, calls)
        fused = run(mlp, fuse=True, steps=2)
        assert set(calls) == {id(p) for p in mlp.parameters()} and set(calls.values()) == {2}
        for key in ("fc1.w", "fc1.b", "fc2.w", "fc2.b"):
            assert fused[key].dtype == torch.float32
            assert torch.equal(fused[key], 2 * plain[key]), key  # 0 + g + g == 2g exactly


def test_attach_main_grads_reports_fused_params_once():
    mlp = build("grouped", "swiglu", False, None, grouped=True, fuse=True)
    calls: dict[int, int] = {}
    for p in mlp.parameters():
        p.moectl_grad_ready_hook = lambda q: calls.__setitem__(id(q), calls.get(id(q), 0) + 1)
    run(mlp, fuse=True)
    assert set(calls.values()) == {1}


def test_mixed_layout_grouped_weight_per_expert_bias():
    """single_grouped_weight with per-expert biases (TE allows it, with a warning) is the same math."""
    ref = run(build("grouped", "swiglu", True, None, grouped=False, fuse=False), fuse=False)
    cfg = MoEConfig(num_experts=E, ffn_hidden_size=F, add_bias=True, single_grouped_weight=True,
                    single_grouped_bias=False, backend="grouped")  # fmt: skip
    mlp = GroupedMLP(cfg, D, init_std=0.3, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for lin in (mlp.linear_fc1, mlp.linear_fc2):
            b_EO = torch.randn(E, lin.bias_params()[0].shape[-1], generator=g) * 0.1
            for p, v in zip(lin.bias_params(), b_EO.unbind(0)):
                p.copy_(v)
    got = run(mlp, fuse=False)
    for key in ref:
        assert torch.equal(got[key], ref[key]), key
