"""Causal self-attention: RoPE, grouped-query attention through `scaled_dot_product_attention`.

`linear_qkv.weight` follows Megatron-Core's layout: rows grouped per query group, each group holding
its `heads // groups` query heads, then its key head, then its value head. Checkpoint converters rely
on this order (HF stores q, k, v separately).
Shapes: B batch, S sequence, D hidden, N query heads, G query groups (kv heads), C head dim. C is
`model.kv_channels` and need not be D / N (Qwen3-30B-A3B: D 2048, N 32, C 128), so `linear_qkv` is
[(N + 2G) * C, D] (R = (N + 2G) * C qkv rows) and `linear_proj` [D, N * C].
Both projections are `trainer.linear.Linear`: nn.Linear without a recipe, the recipe's GEMMs with one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.linear import Linear
from trainer.norm import RMSNorm, rms_norm
from trainer.precision import Recipe


def rope_cache(seq_length: int, head_dim: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """cos/sin tables `[S, C/2, 2]` in fp32 for rotate-half RoPE."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32, device=device), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x_BSNC: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (GPT-NeoX / Llama / Megatron convention): pairs (i, i + C/2).

    On `[B, S, heads, C]`, the layout the projection writes: a compiled region then writes the rotated
    heads contiguous in that layout, the attention's output follows its query's layout (cuDNN's does), and
    merging the heads after it is a view instead of a transposing copy, forward and backward.
    """
    s = x_BSNC.shape[1]
    cos, sin = cache[:s, None, :, 0], cache[:s, None, :, 1]  # [S, 1, C/2]
    x1, x2 = x_BSNC.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x_BSNC.dtype)


class SelfAttention(nn.Module):
    """GQA self-attention with Megatron-style `linear_qkv` / `linear_proj` parameters.

    `head_dim` is C (None: hidden_size // num_heads).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_groups: int,
        *,
        head_dim: int | None = None,
        qk_layernorm: bool = False,
        norm_epsilon: float = 1e-5,
        dtype: torch.dtype = torch.float32,
        recipe: Recipe | None = None,
        gradient_accumulation_fusion: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_groups = num_heads, num_groups
        self.head_dim = head_dim or hidden_size // num_heads
        qkv_rows = (num_heads + 2 * num_groups) * self.head_dim
        lin = dict(bias=False, dtype=dtype, recipe=recipe, gradient_accumulation_fusion=gradient_accumulation_fusion)
        self.linear_qkv = Linear(hidden_size, qkv_rows, **lin)  # type: ignore[arg-type]
        self.linear_proj = Linear(num_heads * self.head_dim, hidden_size, **lin)  # type: ignore[arg-type]
        self.q_layernorm = RMSNorm(self.head_dim, norm_epsilon, dtype=dtype) if qk_layernorm else None
        self.k_layernorm = RMSNorm(self.head_dim, norm_epsilon, dtype=dtype) if qk_layernorm else None

    def forward(self, x_BSD: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        return self.linear_proj(self.attend(self.linear_qkv(x_BSD), rope))

    def attend(self, qkv_BSR: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Everything between the two projections: split heads, QK norm, RoPE, attention, merge heads.

        No submodule is called here (QK norm goes through `rms_norm` on the norms' weights), so
        `trainer.compile.compile_regions` can compile this method without tracing module hooks (the
        distributed wrapper's param-gather pre-hooks fire on `SelfAttention` itself, which covers the
        QK norms' weights).
        """
        b, s, _ = qkv_BSR.shape
        per_group = self.num_heads // self.num_groups
        qkv = qkv_BSR.view(b, s, self.num_groups, per_group + 2, self.head_dim)
        q_BSNC = qkv[:, :, :, :per_group].reshape(b, s, self.num_heads, self.head_dim)
        k_BSGC, v_BSGC = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]
        if self.q_layernorm is not None and self.k_layernorm is not None:
            q_BSNC = rms_norm(q_BSNC, self.q_layernorm.weight, self.q_layernorm.eps)
            k_BSGC = rms_norm(k_BSGC, self.k_layernorm.weight, self.k_layernorm.eps)
        q_BSNC, k_BSGC = apply_rope(q_BSNC, rope), apply_rope(k_BSGC, rope)
        q, k, v = (t.transpose(1, 2) for t in (q_BSNC, k_BSGC, v_BSGC))  # [B, heads, S, C] views
        out_BNSC = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.num_groups != self.num_heads
        )
        return out_BNSC.transpose(1, 2).reshape(b, s, -1)
