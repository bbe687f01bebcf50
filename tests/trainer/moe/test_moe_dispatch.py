"""LocalDispatcher: stable permutation, alignment padding, capacity drop-and-pad, combine; and that padding
and empty experts change nothing downstream (outputs, input grads, prob grads, weight grads)."""

from __future__ import annotations

import pytest
import torch

from moectl.core.config.schema import MoEConfig
from moectl.core.errors import ConfigError
from trainer.moe import GroupedMLP, LocalDispatcher, RouterOutput

D = 8


def routed(indices: list[list[int]], probs: list[list[float]], E: int, requires_grad: bool = False) -> RouterOutput:
    idx = torch.tensor(indices)
    p = torch.tensor(probs, requires_grad=requires_grad)
    zero = torch.zeros(())
    return RouterOutput(p, idx, torch.bincount(idx.flatten(), minlength=E), zero, zero)


def test_permutation_is_stable_by_expert_and_padding_is_zero_with_prob_zero():
    ro = routed(
        [[2, 0], [0, 2], [2, 3], [0, 2], [3, 0]], [[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1], [0.8, 0.2]], E=4
    )
    x = torch.arange(5.0)[:, None].repeat(1, D) + 1  # row t is all (t + 1)
    x_PD, rows_E, probs_P, plan = LocalDispatcher(4, align=4).dispatch(x, ro)
    # dropless: P is the static bound (10 routings + 3 pad rows for each of 4 experts -> 20), the slack
    # beyond each expert's own padding (12 rows) goes to the last expert
    assert plan.tokens_per_expert_E.tolist() == [4, 0, 4, 2] and rows_E.tolist() == [4, 0, 4, 12]
    # expert 0: tokens 0,1,3,4 in token order; expert 2: tokens 0,1,2,3; expert 3: tokens 2,4 then 10 pad rows
    assert x_PD[:, 0].tolist() == [1, 2, 4, 5, 1, 2, 3, 4, 3, 5] + [0] * 10
    assert probs_P.tolist() == pytest.approx([0.4, 0.7, 0.9, 0.2, 0.6, 0.3, 0.5, 0.1, 0.5, 0.8] + [0] * 10)
    no_pad = LocalDispatcher(4).dispatch(x, ro)
    assert no_pad[0][:, 0].tolist() == [1, 2, 4, 5, 1, 2, 3, 4, 3, 5]
    assert not no_pad[3].padded and torch.equal(no_pad[3].src_P, no_pad[3].order_R)  # x_PD: the sorted routings


@pytest.mark.parametrize("align", [2, 4, 16])
def test_dropless_aligned_rows_are_static_and_every_segment_stays_aligned(align: int) -> None:
    # a CUDA graph replays one shape: P must not depend on the routing, and each expert's segment must stay a
    # multiple of `align` (quantized grouped GEMMs), the last one included after it takes the slack
    T, K, E = 37, 3, 5
    disp = LocalDispatcher(E, align=align)
    shapes = set()
    for seed, skew in [(0, 0.0), (1, 4.0), (2, 50.0)]:  # balanced to one expert taking nearly everything
        g = torch.Generator().manual_seed(seed)
        scores = torch.rand(T, E, generator=g) + skew * (torch.arange(E) == 1)
        probs, idx = scores.softmax(-1).topk(K, dim=-1)
        counts = torch.bincount(idx.flatten(), minlength=E)
        ro = RouterOutput(probs, idx, counts, torch.zeros(()), torch.zeros(()))
        x = torch.randn(T, D, generator=g)
        x_PD, rows_E, probs_P, plan = disp.dispatch(x, ro)
        shapes.add(x_PD.shape[0])
        assert x_PD.shape[0] == plan.num_rows == int(rows_E.sum()) == disp.dropless_rows(T, K)
        assert bool((rows_E % align == 0).all()) and bool((rows_E >= counts).all())
        assert bool((rows_E[:-1] - counts[:-1] < align).all())  # only the last expert takes the slack
        y = disp.combine(x_PD * probs_P[:, None], plan)
        torch.testing.assert_close(y, x * probs.sum(-1, keepdim=True))
    assert len(shapes) == 1


@pytest.mark.parametrize("kw", [{}, {"align": 8}, {"capacity_factor": 0.75, "align": 4},
                                {"capacity_factor": 0.75, "pad_to_capacity": True}])  # fmt: skip
def test_combine_puts_prob_weighted_rows_back(kw):
    g = torch.Generator().manual_seed(0)
    T, K, E = 7, 2, 3
    scores = torch.rand(T, E, generator=g)
    probs, idx = scores.topk(K, dim=-1)
    ro = RouterOutput(probs, idx, torch.bincount(idx.flatten(), minlength=E), torch.zeros(()), torch.zeros(()))
    x = torch.randn(T, D, generator=g)
    disp = LocalDispatcher(E, **kw)
    x_PD, rows_E, probs_P, plan = disp.dispatch(x, ro)
    assert rows_E.sum() == x_PD.shape[0] == probs_P.shape[0] == plan.num_rows
    y = disp.combine(x_PD * probs_P[:, None], plan)  # "experts" = identity, scaled by prob
    kept = torch.zeros(T * K, dtype=torch.bool)
    kept[plan.order_R[: int(plan.tokens_per_expert_E.sum())]] = True
    expected = x * (probs * kept.view(T, K)).sum(-1, keepdim=True)
    torch.testing.assert_close(y, expected)
    assert int(plan.num_dropped) == T * K - int(kept.sum())
    if "capacity_factor" in kw:
        assert plan.num_dropped > 0  # the case exercises dropping


def test_capacity_keeps_highest_prob_then_earliest_and_pads_to_capacity():
    # T=6, K=1, E=2, factor 1 -> C = 3. Expert 0 has 4 routings: the lowest prob (token 1) is dropped.
    ro = routed([[0], [0], [0], [0], [1], [1]], [[0.9], [0.5], [0.7], [0.6], [0.8], [0.4]], E=2, requires_grad=True)
    x = (torch.arange(6.0)[:, None].repeat(1, D) + 1).requires_grad_()
    disp = LocalDispatcher(2, capacity_factor=1.0)
    x_PD, rows_E, probs_P, plan = disp.dispatch(x, ro)
    assert rows_E.tolist() == [3, 2] and x_PD[:, 0].tolist() == [1, 3, 4, 5, 6] and int(plan.num_dropped) == 1
    # ties: all probs equal -> the earliest tokens stay
    tie = routed([[0]] * 4 + [[1]] * 2, [[0.5]] * 6, E=2)
    assert LocalDispatcher(2, capacity_factor=1.0).dispatch(x, tie)[0][:, 0].tolist() == [1, 2, 3, 5, 6]
    # pad to capacity: static P = E * C (rounded up to align), zero rows with prob 0
    padded = LocalDispatcher(2, capacity_factor=1.0, pad_to_capacity=True, align=4)
    x_PD, rows_E, probs_P, plan = padded.dispatch(x, ro)
    assert rows_E.tolist() == [4, 4] and plan.num_rows == 8
    assert x_PD[:, 0].tolist() == [1, 3, 4, 0, 5, 6, 0, 0] and probs_P[[3, 6, 7]].tolist() == [0, 0, 0]
    y = padded.combine(x_PD * probs_P[:, None], plan)
    assert not y[1].any()  # the dropped token gets nothing from its only expert
    y.sum().backward()
    assert not x.grad[1].any() and ro.probs_TK.grad[1, 0] == 0 and ro.probs_TK.grad[0, 0] == D * 1


def test_bad_capacity_settings_are_config_errors():
    with pytest.raises(ConfigError, match="capacity"):
        LocalDispatcher(4, pad_to_capacity=True)
    with pytest.raises(ConfigError, match="positive"):
        LocalDispatcher(4, capacity_factor=0.0)


def pipeline(backend: str, disp: LocalDispatcher, ro_probs: torch.Tensor, idx: torch.Tensor, x: torch.Tensor):
    """Dispatch -> GroupedMLP -> combine; returns output and grads of x, probs, and the expert weights."""
    E = 4
    cfg = MoEConfig(num_experts=E, ffn_hidden_size=8, backend=backend, add_bias=True, single_grouped_bias=True)
    mlp = GroupedMLP(cfg, D, init_std=0.3, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # non-zero biases: padded rows would leak act(b1) if their prob were not 0
        mlp.linear_fc1.bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(6))
        mlp.linear_fc2.bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(7))
    x = x.clone().requires_grad_()
    probs = ro_probs.clone().requires_grad_()
    ro = RouterOutput(probs, idx, torch.bincount(idx.flatten(), minlength=E), torch.zeros(()), torch.zeros(()))
    x_PD, rows_E, probs_P, plan = disp.dispatch(x, ro)
    y = disp.combine(mlp(x_PD, rows_E, probs_P), plan)
    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
    params = [mlp.linear_fc1.weight, mlp.linear_fc1.bias, mlp.linear_fc2.weight, mlp.linear_fc2.bias]
    return [y, x.grad, probs.grad] + [p.grad for p in params]


def routing(T: int = 9, K: int = 2, empty: int = 1):
    g = torch.Generator().manual_seed(11)
    scores = torch.rand(T, 4, generator=g)
    scores[:, empty] = -1  # nobody picks this expert
    probs, idx = scores.topk(K, dim=-1)
    return probs, idx, torch.randn(T, D, generator=g)


@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_alignment_padding_and_empty_experts_change_nothing(backend):
    probs, idx, x = routing()
    ref = pipeline(backend, LocalDispatcher(4), probs, idx, x)
    assert not ref[3][1].any() and not ref[5][1].any()  # the empty expert: zero weight grads
    for align in (8, 16):
        got = pipeline(backend, LocalDispatcher(4, align=align), probs, idx, x)
        for i, (a, b) in enumerate(zip(got, ref)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"align={align} output {i}: {m}")


@pytest.mark.parametrize("pad", [False, True])
def test_drop_equals_zeroing_the_dropped_probs(pad):
    """Capacity dropping == dropless routing with the dropped routings' probs set to 0 (except their dprob)."""
    probs, idx, x = routing(T=10)
    disp = LocalDispatcher(4, capacity_factor=0.8, pad_to_capacity=pad, align=4)
    got = pipeline("grouped", disp, probs, idx, x)
    counts = torch.bincount(idx.flatten(), minlength=4)
    _, _, _, plan = disp.dispatch(x, RouterOutput(probs, idx, counts, torch.zeros(()), torch.zeros(())))
    kept = torch.zeros(idx.numel(), dtype=torch.bool)
    kept[plan.order_R[: int(plan.tokens_per_expert_E.sum())]] = True
    kept = kept.view_as(probs)
    assert not kept.all()
    ref = pipeline("grouped", LocalDispatcher(4), probs * kept, idx, x)
    for i, (a, b) in enumerate(zip(got, ref)):
        if i == 2:  # dprobs: ours is exactly 0 where dropped; the reference's is not
            assert not a[~kept].any()
            a, b = a[kept], b[kept]
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"output {i}: {m}")


@pytest.mark.parametrize("pad", [True, False], ids=["drop-and-pad", "dropless"])
def test_alltoall_under_drop_and_pad_reads_nothing_on_the_host(pad: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop-and-pad fixes every split size (each source sends each expert its capacity), which is what lets a
    CUDA graph hold the expert-parallel micro-batch (MOE058). Dropless reads the counts: the check bites."""
    from trainer.moe.dispatch_alltoall import AllToAllDispatcher
    from trainer.parallel.groups import Group

    T, D, E, K = 12, 8, 4, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    routed = RouterOutput(torch.rand(T, K, generator=g), idx, torch.bincount(idx.flatten(), minlength=E),
                          torch.zeros(()), torch.zeros(()))  # fmt: skip
    disp = AllToAllDispatcher(E, Group(ranks=(0,), rank=0, pg=None), capacity_factor=1.25 if pad else None,
                              pad_to_capacity=pad)  # fmt: skip
    local = LocalDispatcher(E, capacity_factor=1.25 if pad else None, pad_to_capacity=pad)
    want_PD, want_rows, want_probs, want_plan = local.dispatch(x, routed)

    def host_read(*_: object) -> None:
        raise AssertionError("a host read of a device value")

    for name in ("tolist", "item", "__int__", "__index__", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    if not pad:
        with pytest.raises(AssertionError, match="host read"):
            disp.dispatch(x, routed)
        return
    x_PD, rows, probs_P, plan = disp.dispatch(x, routed)
    y_TD = disp.combine(x_PD * 2, plan)
    monkeypatch.undo()
    assert torch.equal(x_PD, want_PD) and torch.equal(rows, want_rows) and torch.equal(probs_P, want_probs)
    assert torch.equal(y_TD, local.combine(want_PD * 2, want_plan))
