"""Causal self-attention: RoPE (`trainer/rope.py`), grouped-query attention through
`scaled_dot_product_attention`.

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

from moectl.core.facts import QKV_ROWS_ATTR, QkvRows
from trainer.linear import Linear
from trainer.norm import RMSNorm, rms_norm
from trainer.precision import Recipe
from trainer.rope import apply_rope, fast_rope, rope_qkv, split_qkv


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
        # three linear maps in Megatron's per-group rows (Muon orthogonalises them apart, as Megatron does)
        rows = QkvRows(num_groups, num_heads // num_groups * self.head_dim, self.head_dim)
        setattr(self.linear_qkv.weight, QKV_ROWS_ATTR, rows)
        self.q_layernorm = RMSNorm(self.head_dim, norm_epsilon, dtype=dtype) if qk_layernorm else None
        self.k_layernorm = RMSNorm(self.head_dim, norm_epsilon, dtype=dtype) if qk_layernorm else None

    def forward(self, x_BSD: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        fused = self.q_layernorm is None and fast_rope(x_BSD.device)
        return self.linear_proj(self.attend(self.linear_qkv(x_BSD), rope, fused))

    def attend(self, qkv_BSR: torch.Tensor, rope: torch.Tensor, fused_rope: bool = False) -> torch.Tensor:
        """Everything between the two projections: split heads, QK norm, RoPE, attention, merge heads.

        `fused_rope` (no QK norm; decided outside, so a compiled region guards on it): the split and RoPE as
        the one op `trainer.rope.rope_qkv` (its Triton kernels on CUDA) instead of views and `apply_rope`.

        No submodule is called here (QK norm goes through `rms_norm` on the norms' weights), so
        `trainer.compile.compile_regions` can compile this method without tracing module hooks (the
        distributed wrapper's param-gather pre-hooks fire on `SelfAttention` itself, which covers the
        QK norms' weights).
        """
        b, s, _ = qkv_BSR.shape
        if fused_rope:
            q_BSNC, k_BSGC, v_BSGC = rope_qkv(qkv_BSR, rope, self.num_heads, self.num_groups)
        else:
            q_BSGPC, k_BSGC, v_BSGC = split_qkv(qkv_BSR, self.num_heads, self.num_groups)
            q_BSNC = q_BSGPC.reshape(b, s, self.num_heads, self.head_dim)
            if self.q_layernorm is not None and self.k_layernorm is not None:
                q_BSNC = rms_norm(q_BSNC, self.q_layernorm.weight, self.q_layernorm.eps)
                k_BSGC = rms_norm(k_BSGC, self.k_layernorm.weight, self.k_layernorm.eps)
            q_BSNC, k_BSGC = apply_rope(q_BSNC, rope), apply_rope(k_BSGC, rope)
        q, k, v = (t.transpose(1, 2) for t in (q_BSNC, k_BSGC, v_BSGC))  # [B, heads, S, C] views
        out_BNSC = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.num_groups != self.num_heads
        )
        return out_BNSC.transpose(1, 2).reshape(b, s, -1)
