import torch

from moectl.core.config.schema import ModelConfig, MoEConfig
from trainer.flops import flops_per_token, peak_tflops


def test_flops_count_only_active_experts():
    m = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=8)
    few = flops_per_token(m, MoEConfig(num_experts=8, router_topk=1, ffn_hidden_size=32))
    many = flops_per_token(m, MoEConfig(num_experts=64, router_topk=1, ffn_hidden_size=32))
    two = flops_per_token(m, MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=32))
    # More experts only add router columns (64 -> 64*64 vs 8*64); a second active expert adds a full expert.
    assert many - few == 6 * (64 - 8) * 64
    assert two - few == 6 * 3 * 32 * 64


def test_hand_count_for_one_layer():
    m = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_query_groups=1, vocab_size=10, seq_length=4)
    e = MoEConfig(num_experts=2, router_topk=1, ffn_hidden_size=4, activation="squared_relu")
    head_dim = 4
    attn = 8 * (2 + 2) * head_dim + 2 * head_dim * 8
    expert = 4 * 8 + 4 * 8
    expected = 6 * (10 * 8 + attn + expert + 2 * 8) + 12 * 1 * 4 * 8
    assert flops_per_token(m, e) == expected


def test_no_peak_on_cpu():
    assert peak_tflops(torch.device("cpu")) is None
