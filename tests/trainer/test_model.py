import pytest
import torch

from moectl.core.config.schema import ModelConfig, MoEConfig
from moectl.core.params import count_params
from trainer.model import GPTMoE


def small(**kw) -> tuple[ModelConfig, MoEConfig]:
    m = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
             vocab_size=64, seq_length=16)
    m.update(kw)
    return ModelConfig(**m), MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=16)


def test_state_dict_keys_follow_megatron_core():
    mcfg, ecfg = small(moe_layer_freq=[1, 0])
    keys = set(GPTMoE(mcfg, ecfg).state_dict())
    for k in [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.mlp.router.weight",
        "decoder.layers.0.mlp.experts.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.linear_fc2.weight",
        "decoder.layers.1.mlp.linear_fc1.weight",
        "decoder.layers.1.mlp.linear_fc2.weight",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    ]:
        assert k in keys, k
    sd = GPTMoE(mcfg, ecfg).state_dict()
    assert sd["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 8, 32)
    assert sd["decoder.layers.0.mlp.experts.linear_fc1.weight"].shape == (4, 32, 32)  # [E, 2F, D]


def test_per_expert_keys_and_tied_head():
    mcfg, ecfg = small(tie_embeddings=True)
    ecfg.single_grouped_weight = False
    keys = set(GPTMoE(mcfg, ecfg).state_dict())
    assert "output_layer.weight" not in keys
    assert {f"decoder.layers.1.mlp.experts.linear_fc1.weight{e}" for e in range(4)} <= keys
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight" not in keys


def test_forward_shapes_loss_and_grads_reach_every_param():
    mcfg, ecfg = small()
    model = GPTMoE(mcfg, ecfg, seed=3)
    tokens = torch.randint(0, 64, (2, 16))
    assert model(tokens).shape == (2, 16, 64)
    parts = model.loss(tokens, tokens.roll(-1, 1))
    assert parts.aux_loss.item() > 0  # aux_loss_coeff defaults to 0.01
    parts.total.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_same_seed_same_model_other_seed_other_model():
    mcfg, ecfg = small()
    a, b, c = GPTMoE(mcfg, ecfg, seed=1), GPTMoE(mcfg, ecfg, seed=1), GPTMoE(mcfg, ecfg, seed=2)
    for (n, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), n
    assert not torch.equal(a.embedding.word_embeddings.weight, c.embedding.word_embeddings.weight)


def test_causality_future_tokens_do_not_change_past_logits():
    mcfg, ecfg = small()
    model = GPTMoE(mcfg, ecfg).eval()
    t = torch.randint(0, 64, (1, 16))
    t2 = t.clone()
    t2[0, 10:] = (t2[0, 10:] + 1) % 64
    # MoE routing is per token, so earlier positions must be untouched.
    torch.testing.assert_close(model(t)[0, :10], model(t2)[0, :10], rtol=0, atol=1e-6)


def test_active_params_count_top_k_of_experts():
    mcfg, ecfg = small(moe_layer_freq=1)
    model = GPTMoE(mcfg, ecfg)
    counts = count_params(mcfg, ecfg)
    total, active = counts.total, counts.active
    assert total == sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert total - active == expert - expert * 2 // 4


@pytest.mark.parametrize("groups", [1, 4])
def test_gqa_and_mha_variants_run(groups):
    mcfg, ecfg = small(num_query_groups=groups, qk_layernorm=True)
    out = GPTMoE(mcfg, ecfg)(torch.randint(0, 64, (1, 8)))
    assert torch.isfinite(out).all()


def test_kv_channels_sets_the_head_dim_apart_from_hidden_over_heads():
    # Qwen3-30B-A3B's shape in miniature: hidden 32, 4 heads of 16 (not 32 / 4 = 8), 2 kv groups.
    mcfg, ecfg = small(kv_channels=16, qk_layernorm=True)
    model = GPTMoE(mcfg, ecfg)
    sd = model.state_dict()
    assert sd["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 16, 32)
    assert sd["decoder.layers.0.self_attention.linear_proj.weight"].shape == (32, 4 * 16)
    assert sd["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (16,)
    assert model.rope.shape == (16, 8, 2)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert model(tokens).shape == (2, 16, 64)
    # the summary's counter and the FLOPs follow the head dim, as the built model does
    from moectl.core.config.schema import Config
    from moectl.core.summary import param_counts
    from trainer.flops import flops_per_token

    counts = param_counts(Config(model=mcfg, moe=ecfg), 1)
    assert counts.total == sum(p.numel() for p in model.parameters()) == count_params(mcfg, ecfg).total
    plain = small()[0]
    attn_extra = 2 * ((4 + 2 * 2) * 8 * 32 + 32 * 4 * 8)  # the head dim doubles both attention matrices
    scores_extra = 12 * 2 * 16 * 4 * 8
    assert flops_per_token(mcfg, ecfg) - flops_per_token(plain, ecfg) == 6 * attn_extra + scores_extra


def _unfused_forward(model: GPTMoE, tokens: torch.Tensor) -> torch.Tensor:
    """The block as written before the residual adds moved into the norms: add, then norm."""
    x = model.embedding(tokens)
    for layer in model.decoder.layers:
        x = x + layer.self_attention(layer.input_layernorm(x), model.rope)
        x = x + layer.mlp(layer.pre_mlp_layernorm(x))
    return model.output_layer(model.decoder.final_layernorm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_adds_in_the_norms_change_no_bit(dtype):
    """The layer hands its MLP branch to the next norm unadded (trainer/norm.py); eagerly that computes
    the same sums in the same dtype as the add-then-norm block, so logits and every grad are bitwise equal.
    A norm that dropped the branch (or the final norm forgetting the last layer's) would differ."""
    mcfg, ecfg = small(num_layers=3, moe_layer_freq=[1, 0, 1])
    model = GPTMoE(mcfg, ecfg, seed=5, params_dtype=dtype)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    got = model(tokens)
    got.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = _unfused_forward(model, tokens)
    want.float().square().mean().backward()
    assert torch.equal(got, want)
    for n, p in model.named_parameters():
        assert torch.equal(grads[n], p.grad), n
