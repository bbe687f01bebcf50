"""MoELayer: keys, init, expert_parallel marks, aux losses with grad, and layout parity through the whole
layer (router included) and through a few optimizer steps."""

from __future__ import annotations

import sys

import pytest
import torch

from moectl.core.config.schema import MoEConfig
from trainer.moe import MoELayer

D = 8


def layer(grouped: bool, **kw) -> MoELayer:
    base = dict(num_experts=4, router_topk=2, ffn_hidden_size=8, add_bias=True, aux_loss_coeff=0.01,
                z_loss_coeff=0.001, single_grouped_weight=grouped, single_grouped_bias=grouped)  # fmt: skip
    base.update(kw)
    align = base.pop("align", 1)
    gen = torch.Generator().manual_seed(0)
    return MoELayer(MoEConfig(**base), D, init_std=0.2, params_dtype=torch.float32, generator=gen, align=align)


def test_state_dict_keys_shapes_and_expert_parallel_marks():
    g, p = layer(True), layer(False)
    assert list(g.state_dict()) == ["router.weight", "experts.linear_fc1.weight", "experts.linear_fc1.bias",
                                    "experts.linear_fc2.weight", "experts.linear_fc2.bias"]  # fmt: skip
    assert g.state_dict()["experts.linear_fc1.weight"].shape == (4, 16, D)
    assert g.state_dict()["experts.linear_fc2.weight"].shape == (4, D, 8)
    sd = p.state_dict()
    assert {f"experts.linear_fc1.weight{e}" for e in range(4)} <= sd.keys()
    assert sd["experts.linear_fc1.weight3"].shape == (16, D) and sd["experts.linear_fc2.bias3"].shape == (D,)
    assert all(getattr(q, "expert_parallel", False) for q in g.experts.parameters())
    assert all(getattr(q, "expert_parallel", False) for q in p.experts.parameters())
    assert not getattr(g.router.weight, "expert_parallel", False)
    sq = layer(False, activation="squared_relu").state_dict()
    assert sq["experts.linear_fc1.weight0"].shape == (8, D)


def test_same_init_in_both_layouts_from_one_draw():
    g, p = layer(True).state_dict(), layer(False).state_dict()
    assert torch.equal(g["router.weight"], p["router.weight"])
    for fc in ("linear_fc1", "linear_fc2"):
        per_expert = torch.stack([p[f"experts.{fc}.weight{e}"] for e in range(4)])
        assert torch.equal(g[f"experts.{fc}.weight"], per_expert)
        assert not g[f"experts.{fc}.bias"].any()
    w = g["experts.linear_fc1.weight"]
    assert not torch.equal(w[0], w[1])  # slices of one draw, not one draw repeated
    # params_dtype casts the fp32 draw: a bf16 layer starts from the rounded fp32 values
    f32, b16 = (
        MoELayer(MoEConfig(num_experts=4), D, init_std=0.2, params_dtype=dt, generator=torch.Generator().manual_seed(0))
        for dt in (torch.float32, torch.bfloat16)
    )
    assert b16.experts.linear_fc1.weight.dtype == torch.bfloat16
    assert torch.equal(b16.experts.linear_fc1.weight, f32.experts.linear_fc1.weight.bfloat16())
    assert b16.router.weight.dtype == torch.float32


def stats_and_grads(m: MoELayer, x: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    y = m(x)
    loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + m.aux_loss
    loss.backward()
    out = {"y": y.detach(), "loss": loss.detach(), "dx": x.grad, "router": m.router.weight.grad}
    for fc in ("linear_fc1", "linear_fc2"):
        lin = getattr(m.experts, fc)
        for role, params in (("w", lin.weight_params()), ("b", lin.bias_params())):
            grads = [q.grad for q in params]
            out[f"{fc}.{role}"] = grads[0] if len(grads) == 1 else torch.stack(grads)
    return out


@pytest.mark.parametrize("kw", [
    {"backend": "grouped", "align": 8},
    {"backend": "loop", "router_score_function": "sigmoid", "activation": "quick_geglu", "glu_interleave_size": 4},
    {"backend": "grouped", "capacity_factor": 0.9, "pad_expert_input_to_capacity": True},
])  # fmt: skip
def test_layer_bitwise_parity_including_router_and_parent_grads(kw):
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))
    a, b = stats_and_grads(layer(True, **kw), x), stats_and_grads(layer(False, **kw), x)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert a["linear_fc1.w"].abs().sum() > 0 and a["linear_fc2.w"].abs().sum() > 0 and a["router"].abs().sum() > 0


@pytest.mark.parametrize("pad", [False, True], ids=["drop", "drop-and-pad"])
@pytest.mark.parametrize("factor", [3.0, 1e308, sys.float_info.max])
def test_a_factor_past_every_token_trains_bitwise_as_the_bound(pad: bool, factor: float) -> None:
    """An expert gets at most T routings (a token's K experts are distinct), so from capacity_factor E/K on
    nothing is dropped: every larger factor is bounded to that capacity, T rows, and gives bitwise the loss
    and grads of factor E/K. 1e308 (finite, so MOE023 lets it through) overflowed to inf in the first forward."""
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))  # T = 10 tokens, top-2 of 4 experts
    bound = layer(True, capacity_factor=4 / 2, pad_expert_input_to_capacity=pad)
    big = layer(True, capacity_factor=factor, pad_expert_input_to_capacity=pad)
    want, got = stats_and_grads(bound, x), stats_and_grads(big, x)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert int(big.stats.num_dropped) == 0
    assert big.dispatcher.rows_per_expert(T=10, K=2) == (10 if pad else None)


@pytest.mark.parametrize("pad", [False, True], ids=["drop", "drop-and-pad"])
def test_the_bound_trains_bitwise_as_the_unbounded_capacity(pad: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound against the formula it replaced (ceil(factor T K / E), unbounded): factor 3 gives 15 rows an
    expert there, 10 bounded; the loss and every grad are the same bits, padded or not."""
    import math

    from trainer.moe import dispatch

    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))
    bounded = stats_and_grads(layer(True, capacity_factor=3.0, pad_expert_input_to_capacity=pad), x)
    monkeypatch.setattr(dispatch, "expert_capacity", lambda f, T, K, E: math.ceil(f * T * K / E))
    unbounded_layer = layer(True, capacity_factor=3.0, pad_expert_input_to_capacity=pad)
    assert unbounded_layer.dispatcher.rows_per_expert(T=10, K=2) == (15 if pad else None)
    unbounded = stats_and_grads(unbounded_layer, x)
    for key in bounded:
        assert torch.equal(bounded[key], unbounded[key]), key


def test_aux_loss_and_load_stats():
    m = layer(True, capacity_factor=0.5)
    with pytest.raises(RuntimeError, match="before"):
        m.aux_loss
    assert m.tokens_per_expert is None
    m(torch.randn(3, 4, D))
    assert m.aux_loss.requires_grad and m.aux_loss.dtype == torch.float32
    torch.testing.assert_close(m.aux_loss, m.stats.load_balancing_loss + m.stats.z_loss)
    assert m.stats.load_balancing_loss > 0 and m.stats.z_loss > 0
    assert m.tokens_per_expert.dtype == torch.int64 and int(m.tokens_per_expert.sum()) == 12 * 2
    assert int(m.stats.num_dropped) > 0  # C = ceil(0.5 * 24 / 4) = 3 per expert, 24 routings


def test_short_training_run_same_losses_in_both_layouts():
    x = torch.randn(4, 6, D, generator=torch.Generator().manual_seed(2))
    target = torch.randn(4, 6, D, generator=torch.Generator().manual_seed(3))
    losses = []
    for grouped in (True, False):
        m = layer(grouped, align=4)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        run = []
        for _ in range(5):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), target) + m.aux_loss
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    assert losses[0] == losses[1]
    assert losses[0][-1] < losses[0][0]


def test_bf16_grouped_close_to_fp32_loop():
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(4))
    outs = []
    for dtype, backend in ((torch.float32, "loop"), (torch.bfloat16, "grouped")):
        cfg = MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=16, backend=backend)
        gen = torch.Generator().manual_seed(0)
        m = MoELayer(cfg, 16, init_std=0.2, params_dtype=dtype, generator=gen, align=8)
        outs.append(m(x.to(dtype)).float())
    err = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert torch.isfinite(outs[1]).all() and err < 2e-2
