"""TopKRouter against hand-computed cases: probs, top-k, counts, aux loss, z-loss, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from moectl.core.config.schema import MoEConfig
from trainer.moe import TopKRouter
from trainer.sort_keys import compact_ids
from trainer.moe.router import expert_counts

# Four tokens, three experts. With router weight = I, the logits are the inputs, so choosing inputs
# log(p) + c makes softmax return exactly the distributions p below, and logsumexp = c.
P = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.15, 0.25, 0.6], [0.7, 0.2, 0.1]])
C = 2.0


def router(**kw) -> TopKRouter:
    cfg = MoEConfig(num_experts=3, **kw)
    r = TopKRouter(cfg, hidden_size=3, init_std=0.02)
    with torch.no_grad():
        r.weight.copy_(torch.eye(3))
    return r


def test_top1_softmax_counts_and_aux_loss_by_hand():
    r = router(router_topk=1, aux_loss_coeff=0.01)
    out = r(P.log() + C)
    assert out.indices_TK.dtype == torch.int64 and out.probs_TK.dtype == torch.float32
    assert out.indices_TK.flatten().tolist() == [0, 1, 2, 0]
    torch.testing.assert_close(out.probs_TK.flatten(), torch.tensor([0.5, 0.6, 0.6, 0.7]))
    assert out.tokens_per_expert_E.tolist() == [2, 1, 1]
    # f = [2, 1, 1] / 4; P_e = column means = [0.3625, 0.3375, 0.3]; E * sum f*P = 3 * 0.340625
    torch.testing.assert_close(out.aux_loss, torch.tensor(0.01 * 3 * 0.340625))
    assert out.z_loss == 0  # z_loss_coeff defaults to 0: disabled, no graph


def test_z_loss_by_hand_and_its_gradient():
    r = router(router_topk=1, aux_loss_coeff=0.0, z_loss_coeff=0.1)
    x = (P.log() + C).requires_grad_()
    out = r(x)
    torch.testing.assert_close(out.z_loss, torch.tensor(0.1 * C * C))
    out.z_loss.backward()
    # d/dlogit of mean(lse^2) = 2 lse softmax / T
    torch.testing.assert_close(x.grad, 2 * C * P / 4 * 0.1)


def test_top2_softmax_with_and_without_renormalisation():
    raw = router(router_topk=2)(P.log())
    assert raw.indices_TK.tolist() == [[0, 1], [1, 2], [2, 1], [0, 1]]
    assert raw.tokens_per_expert_E.tolist() == [2, 4, 2]
    torch.testing.assert_close(raw.probs_TK[0], torch.tensor([0.5, 0.3]))
    normed = router(router_topk=2, router_norm_topk_prob=True)(P.log())
    torch.testing.assert_close(normed.probs_TK[0], torch.tensor([0.625, 0.375]))
    torch.testing.assert_close(normed.probs_TK.sum(-1), torch.ones(4))
    assert normed.tokens_per_expert_E.sum() == 8


def test_sigmoid_scores_normalised_over_topk():
    logits = torch.tensor([[2.0, 0.0, -1.0], [-3.0, 1.0, 0.5]])
    out = router(router_topk=2, router_score_function="sigmoid", aux_loss_coeff=0.01)(logits)
    s = torch.sigmoid(logits)
    assert out.indices_TK.tolist() == [[0, 1], [1, 2]]
    torch.testing.assert_close(out.probs_TK[0], s[0, :2] / s[0, :2].sum())
    torch.testing.assert_close(out.probs_TK[1], s[1, 1:] / s[1, 1:].sum())
    # aux uses the sigmoid scores normalised over all experts (Megatron's choice)
    sn = s / s.sum(-1, keepdim=True)
    f = torch.tensor([1.0, 2.0, 1.0]) / 4
    torch.testing.assert_close(out.aux_loss, 0.01 * 3 * (f * sn.mean(0)).sum())
    # top-1 sigmoid keeps the raw score: a renormalised single prob would be 1 and carry no gradient
    top1 = router(router_topk=1, router_score_function="sigmoid")(logits)
    torch.testing.assert_close(top1.probs_TK.flatten(), torch.stack([s[0, 0], s[1, 1]]))


def test_balanced_routing_gives_aux_equal_to_coeff():
    r = router(router_topk=1, aux_loss_coeff=0.5)
    out = r(torch.eye(3) * 5)  # each token to its own expert, symmetric distributions
    torch.testing.assert_close(out.aux_loss, torch.tensor(0.5))


def test_router_gets_gradient_from_probs_and_aux_loss_in_fp32():
    cfg = MoEConfig(num_experts=4, router_topk=2, aux_loss_coeff=0.1)
    r = TopKRouter(cfg, hidden_size=8, init_std=0.1, generator=torch.Generator().manual_seed(0))
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    out = r(x)
    assert out.probs_TK.dtype == torch.float32 and out.aux_loss.dtype == torch.float32
    out.aux_loss.backward(retain_graph=True)
    g_aux = r.weight.grad.clone()
    assert g_aux.abs().sum() > 0
    r.weight.grad = None
    out.probs_TK.sum().backward()
    assert r.weight.grad.abs().sum() > 0


def test_init_uses_the_generator_and_the_state_dict_key():
    cfg = MoEConfig(num_experts=4)
    a = TopKRouter(cfg, 8, 0.02, torch.Generator().manual_seed(3))
    b = TopKRouter(cfg, 8, 0.02, torch.Generator().manual_seed(3))
    assert torch.equal(a.weight, b.weight) and list(a.state_dict()) == ["weight"]
    big = TopKRouter(MoEConfig(num_experts=64), 256, 0.02)
    assert math.isclose(float(big.weight.detach().std()), 0.02, rel_tol=0.05)
    with pytest.raises(ValueError, match="router_topk"):
        TopKRouter(MoEConfig(num_experts=2, router_topk=3), 8, 0.02)


@pytest.mark.parametrize("E", [4, 255, 256, 32767, 40000])
def test_compact_ids_sort_like_int64_and_count_exactly(E: int) -> None:
    """The narrow keys the routing sorts use: the same stable permutation and the same counts as int64 ids,
    across the dtype boundaries (uint8 up to 255, int16 up to 32767, then int32)."""
    gen = torch.Generator().manual_seed(E)
    key_N = torch.randint(0, E + 1, (6000,), generator=gen)
    key_N[:3] = torch.tensor([0, E, E - 1])  # both ends present
    narrow = compact_ids(key_N, E)
    assert narrow.element_size() == (1 if E <= 255 else 2 if E <= 32767 else 4)
    assert torch.equal(narrow.long(), key_N)
    assert torch.equal(torch.argsort(narrow, stable=True), torch.argsort(key_N, stable=True))
    indices_TK = key_N.clamp(max=E - 1).view(-1, 4)
    assert torch.equal(expert_counts(indices_TK, E), torch.bincount(indices_TK.flatten(), minlength=E))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device tool)")
@pytest.mark.parametrize("T,E,K", [(8192, 32, 4), (8192, 128, 8), (1000, 256, 8), (300, 7, 7), (5, 64, 1)])
def test_triton_topk_ids_are_torch_topks(T: int, E: int, K: int) -> None:
    """The kernel's ids (trainer/kernels/topk_triton.py) are `torch.topk`'s, best first, on softmax scores."""
    from trainer.kernels import has_triton

    if not has_triton():
        pytest.skip("needs Triton")
    from trainer.kernels.topk_triton import topk_ids

    scores = torch.randn(T, E, generator=torch.Generator().manual_seed(E)).softmax(-1).cuda()
    assert torch.equal(topk_ids(scores, K), scores.topk(K, dim=-1).indices)
    # a non-finite step's rows: NaN ranks first (as in torch.topk), ties by the lower id, and no id repeats
    scores[0] = float("nan")
    scores[-1] = 0.0
    scores[-1, E - 1] = float("nan")
    ids = topk_ids(scores, K)
    assert ids[0].tolist() == list(range(K)) and ids[-1].tolist() == [E - 1, *range(K - 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device tool)")
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("compiled", [False, True])
def test_router_on_the_triton_topk_is_the_torch_router(score: str, compiled: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The router with its top-k ids from the kernel gives torch.topk's probs, ids, counts, aux loss and grads:
    bit for bit eagerly. Under inductor (the custom op inside the compiled `route`) the routing itself is bit for
    bit too, but the losses and the grad only to rounding: the two graphs fuse the reductions around an opaque op
    and `aten.topk` differently (on an H100 the aux loss and grad of one score function differed in their last
    bits, which one varied with the compile cache's state)."""
    from trainer.kernels import has_triton

    if not has_triton():
        pytest.skip("needs Triton")
    cfg = MoEConfig(num_experts=32, router_topk=4, ffn_hidden_size=16, router_score_function=score,
                    aux_loss_coeff=0.01, z_loss_coeff=0.001)  # fmt: skip
    router = TopKRouter(cfg, 256, init_std=0.02, generator=torch.Generator().manual_seed(0)).cuda()
    if compiled:
        router.route = torch.compile(router.route)  # as trainer/compile.py does
    x = torch.randn(4096, 256, generator=torch.Generator().manual_seed(1)).bfloat16().cuda()
    out = {}
    for fast in ("1", "0"):
        monkeypatch.setenv("MOECTL_TRITON_TOPK", fast)
        router.weight.grad = None
        ro = router(x)
        (ro.probs_TK.square().sum() + ro.aux_loss + ro.z_loss).backward()
        out[fast] = (ro.probs_TK, ro.indices_TK, ro.tokens_per_expert_E, ro.aux_loss, ro.z_loss, router.weight.grad)
    routing, reduced = slice(0, 3), slice(3, 6)  # probs, ids, counts | aux loss, z loss, weight grad
    for a, b in zip(out["1"][routing], out["0"][routing]):
        assert torch.equal(a, b)
    for a, b in zip(out["1"][reduced], out["0"][reduced]):
        if compiled:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
        else:
            assert torch.equal(a, b)
