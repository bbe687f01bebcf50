"""The model's parameters counted from its config: the one counter (validate-config's summary, the run's
banner, FLOPs for MFU), torch-free and checked against `sum(p.numel())` of built models in the tests.

It follows `trainer/model.py`: no linear biases outside the experts, RMSNorm weights only (two per layer,
two more per layer with QK norm, one final), QKV of (heads + 2 x query groups) x head_dim rows, a dense
SwiGLU MLP (fc1 `[2F, D]`, fc2 `[D, F]`) on non-MoE layers, a bias-free router `[E, D]`, expert fc1
`[2F, D]` for gated activations (`[F, D]` otherwise) and fc2 `[D, F]`, expert biases when `add_bias`.
"""

from __future__ import annotations

from dataclasses import dataclass

from moectl.core.config.schema import ModelConfig, MoEConfig
from moectl.core.facts import fc1_rows


@dataclass(frozen=True)
class ModelParams:
    """Parameter counts of the whole model by kind (experts counted over all E)."""

    embedding: int  # the word embedding table
    output_head: int  # the untied output layer (0 when tied to the embedding)
    attention: int  # QKV and output projections
    dense_mlp: int
    router: int
    expert_weights: int
    expert_biases: int
    norms: int
    topk_fraction: float  # router_topk / num_experts: the share of expert params a token uses

    @property
    def experts(self) -> int:
        return self.expert_weights + self.expert_biases

    @property
    def total(self) -> int:
        return self.embedding + self.output_head + self.attention + self.dense_mlp + self.router + self.experts + self.norms

    @property
    def active(self) -> int:
        """Parameters one token uses: everything but the experts, plus top-k of E experts."""
        return self.total - self.experts + int(self.experts * self.topk_fraction)

    def active_matmul(self, vocab_size: int, hidden_size: int) -> float:
        """Matmul parameters one token runs (what model FLOPs count): the active GEMM weights and the output
        head, which is a matmul even when tied; not the embedding lookup, norms or biases."""
        return (self.attention + self.dense_mlp + self.router + self.expert_weights * self.topk_fraction
                + vocab_size * hidden_size)


def count_params(model: ModelConfig, moe: MoEConfig) -> ModelParams:
    """Every parameter of the model `model` and `moe` describe."""
    d, heads = model.hidden_size, model.num_attention_heads
    head_dim = model.head_dim  # model.kv_channels, or d / heads
    attention = (heads + 2 * model.kv_heads) * head_dim * d + heads * head_dim * d
    moe_layers = model.moe_layer_count
    dense_layers = model.num_layers - moe_layers
    rows = fc1_rows(moe.activation, moe.ffn_hidden_size)
    per_expert = rows * d + d * moe.ffn_hidden_size
    per_expert_bias = rows + d if moe.add_bias else 0
    qk_norms = 2 * head_dim if model.qk_layernorm else 0
    return ModelParams(
        embedding=model.vocab_size * d,
        output_head=0 if model.tie_embeddings else model.vocab_size * d,
        attention=model.num_layers * attention,
        dense_mlp=dense_layers * 3 * d * model.ffn_hidden_size,
        router=moe_layers * moe.num_experts * d,
        expert_weights=moe_layers * moe.num_experts * per_expert,
        expert_biases=moe_layers * moe.num_experts * per_expert_bias,
        norms=model.num_layers * (2 * d + qk_norms) + d,
        topk_fraction=moe.router_topk / moe.num_experts,
    )
