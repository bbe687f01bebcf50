"""The GPT decoder with MoE FFNs, written for one device (parallelism wraps it from outside).

    tokens -> embedding -> [RMSNorm -> attention -> + ; RMSNorm -> MoE or dense SwiGLU -> +] x L
           -> final RMSNorm -> output head (optionally tied to the embedding)

Each residual add runs inside the norm that follows it (`RMSNorm(x, delta)`), so a layer returns its
stream and its MLP branch unadded and the next norm adds them.

State-dict keys follow Megatron-Core's GPT so checkpoints and converters read naturally:
`embedding.word_embeddings.weight`, `decoder.layers.N.self_attention.linear_qkv.weight`,
`decoder.layers.N.mlp.router.weight`, `decoder.layers.N.mlp.experts.linear_fc1.weight` (or `weight3`),
`decoder.final_layernorm.weight`, `output_layer.weight`.
Init is one seeded generator drawn in construction order, so equal seeds give equal models, and an
expert layer draws its whole `[E, out, in]` weight at once whatever its storage layout.

Low precision (`recipe`, from `trainer.precision.get_recipe`): every linear layer of the block runs its
GEMMs in the recipe, i.e. attention's `linear_qkv`/`linear_proj` and the dense MLP (`trainer.linear.Linear`)
and the experts' fc1/fc2 (`GroupedMLP`). The embedding, the routers and the output head stay in the params'
dtype, as in TE/Megatron. The recipe changes neither parameters, state-dict keys nor init. Expert segments
must be padded to `recipe.align_size` rows: pass `expert_align=recipe.align_size` (checked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moectl.core.config.schema import ModelConfig, MoEConfig
from moectl.core.facts import GLU_ROWS_ATTR, GluRows
from trainer import regions
from trainer.attention import SelfAttention
from trainer.cross_entropy import cross_entropy, fast_cross_entropy
from trainer.embedding import Embedding
from trainer.init_weights import init_skipped
from trainer.linear import Linear
from trainer.moe import MoELayer
from trainer.norm import RMSNorm
from trainer.precision import Recipe
from trainer.regions import region
from trainer.rope import rope_cache


class DenseMLP(nn.Module):
    """SwiGLU MLP of the non-MoE layers; `linear_fc1` rows are `[gate; up]` as in the experts."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        dtype: torch.dtype,
        *,
        recipe: Recipe | None = None,
        gradient_accumulation_fusion: bool = False,
    ) -> None:
        super().__init__()
        lin = dict(bias=False, dtype=dtype, recipe=recipe, gradient_accumulation_fusion=gradient_accumulation_fusion)
        self.linear_fc1 = Linear(hidden_size, 2 * ffn_hidden_size, **lin)  # type: ignore[arg-type]
        self.linear_fc2 = Linear(ffn_hidden_size, hidden_size, **lin)  # type: ignore[arg-type]
        setattr(self.linear_fc1.weight, GLU_ROWS_ATTR, GluRows())  # [gate; up] rows: two linear maps (Muon splits)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        with region(regions.DENSE_MLP):
            gate, up = self.linear_fc1(x_BSD).chunk(2, dim=-1)
            return self.linear_fc2(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block; `mlp` is an MoE layer or a dense SwiGLU MLP."""

    def __init__(
        self,
        mcfg: ModelConfig,
        moe_cfg: MoEConfig | None,
        mlp: nn.Module,
        dtype: torch.dtype,
        *,
        recipe: Recipe | None = None,
        gradient_accumulation_fusion: bool = False,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(mcfg.hidden_size, mcfg.norm_epsilon, dtype=dtype)
        self.self_attention = SelfAttention(
            mcfg.hidden_size,
            mcfg.num_attention_heads,
            mcfg.kv_heads,
            head_dim=mcfg.head_dim,
            qk_layernorm=mcfg.qk_layernorm,
            norm_epsilon=mcfg.norm_epsilon,
            dtype=dtype,
            recipe=recipe,
            gradient_accumulation_fusion=gradient_accumulation_fusion,
        )
        self.pre_mlp_layernorm = RMSNorm(mcfg.hidden_size, mcfg.norm_epsilon, dtype=dtype)
        self.mlp = mlp

    def forward(
        self, x_BSD: torch.Tensor, rope: torch.Tensor, delta_BSD: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x, m)`: the residual stream before this layer's MLP branch and that branch's output `m`.

        The stream after the layer is `x + m`; that add is left to the next norm (`delta_BSD` of the next
        layer, or the final norm), which fuses it (trainer/norm.py). `delta_BSD` is the previous layer's `m`.
        """
        with region(regions.NORM):
            if delta_BSD is None:
                h_BSD = self.input_layernorm(x_BSD)
            else:
                x_BSD, h_BSD = self.input_layernorm(x_BSD, delta_BSD)
        with region(regions.ATTENTION):
            a_BSD = self.self_attention(h_BSD, rope)
        with region(regions.NORM):
            x_BSD, h_BSD = self.pre_mlp_layernorm(x_BSD, a_BSD)
        return x_BSD, self.mlp(h_BSD)  # the MLP names its own region (the MoE layer: one per part)


class Decoder(nn.Module):
    """The stack of layers and the final norm (Megatron's `decoder`)."""

    def __init__(self, layers: list[DecoderLayer], final_layernorm: RMSNorm) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = final_layernorm


@dataclass
class LossParts:
    """The total training loss and what it is made of (all scalars; `total` carries the graph)."""

    total: torch.Tensor
    lm_loss: torch.Tensor
    aux_loss: torch.Tensor


class GPTMoE(nn.Module):
    """Decoder-only MoE transformer. `forward(tokens) -> logits`; `loss(tokens, targets) -> LossParts`."""

    def __init__(
        self,
        mcfg: ModelConfig,
        moe_cfg: MoEConfig,
        *,
        seed: int = 0,
        params_dtype: torch.dtype = torch.float32,
        gradient_accumulation_fusion: bool = False,
        expert_align: int = 1,
        moe_layer_kwargs: dict | None = None,
        recipe: Recipe | None = None,
    ) -> None:
        super().__init__()
        self.cfg = mcfg
        self.recipe = recipe
        gen = torch.Generator().manual_seed(seed)
        std = mcfg.init_method_std
        # Megatron's output_layer_init_method: residual-branch outputs start smaller with depth.
        out_std = std / math.sqrt(2.0 * mcfg.num_layers)

        # tied: the head's grad reaches the same weight through autograd, so the embedding's must too
        self.embedding = Embedding(mcfg.vocab_size, mcfg.hidden_size, params_dtype,
                                   gradient_accumulation_fusion and not mcfg.tie_embeddings)
        linears = dict(recipe=recipe, gradient_accumulation_fusion=gradient_accumulation_fusion)
        layers = []
        for i in range(mcfg.num_layers):
            if mcfg.is_moe_layer(i):
                mlp: nn.Module = MoELayer(
                    moe_cfg,
                    mcfg.hidden_size,
                    init_std=std,
                    output_init_std=out_std,
                    params_dtype=params_dtype,
                    generator=gen,
                    gradient_accumulation_fusion=gradient_accumulation_fusion,
                    align=expert_align,
                    recipe=recipe,
                    **(moe_layer_kwargs or {}),
                )
            else:
                mlp = DenseMLP(mcfg.hidden_size, mcfg.ffn_hidden_size, params_dtype, **linears)
            layers.append(DecoderLayer(mcfg, moe_cfg, mlp, params_dtype, **linears))
        self.decoder = Decoder(layers, RMSNorm(mcfg.hidden_size, mcfg.norm_epsilon, dtype=params_dtype))
        self.output_layer = (
            None if mcfg.tie_embeddings
            else Linear(mcfg.hidden_size, mcfg.vocab_size, dtype=params_dtype,
                        gradient_accumulation_fusion=gradient_accumulation_fusion)
        )
        self._init_dense(gen, std, out_std)
        self.register_buffer(
            "rope", rope_cache(mcfg.seq_length, mcfg.head_dim, mcfg.rotary_base),
            persistent=False,
        )

    @torch.no_grad()
    def _init_dense(self, gen: torch.Generator, std: float, out_std: float) -> None:
        """Normal init of every non-expert matrix (experts and routers init themselves, in order)."""

        def draw(p: torch.Tensor, s: float) -> None:
            if init_skipped():  # a checkpoint replaces every value (trainer/init_weights.py)
                p.zero_()
                return
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(s))

        draw(self.embedding.word_embeddings.weight, std)
        for layer in self.decoder.layers:
            draw(layer.self_attention.linear_qkv.weight, std)
            draw(layer.self_attention.linear_proj.weight, out_std)
            if isinstance(layer.mlp, DenseMLP):
                draw(layer.mlp.linear_fc1.weight, std)
                draw(layer.mlp.linear_fc2.weight, out_std)
        if self.output_layer is not None:
            draw(self.output_layer.weight, std)

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers, in depth order (for aux losses and load-balance metrics)."""
        return [layer.mlp for layer in self.decoder.layers if isinstance(layer.mlp, MoELayer)]

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        with region(regions.EMBEDDING):
            x_BSD = self.embedding(tokens_BS)
        m_BSD = None  # the last layer's MLP branch, added to the stream by the next norm
        for layer in self.decoder.layers:
            x_BSD, m_BSD = layer(x_BSD, self.rope, m_BSD)
        with region(regions.HEAD):
            if m_BSD is None:
                x_BSD = self.decoder.final_layernorm(x_BSD)
            else:
                x_BSD = self.decoder.final_layernorm(x_BSD, m_BSD)[1]
            if self.output_layer is not None:
                return self.output_layer(x_BSD)  # a module call, so param-gather pre-hooks see the head
            return F.linear(x_BSD, self.embedding.word_embeddings.weight)

    def loss(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor) -> LossParts:
        """Mean next-token cross-entropy (in fp32) plus the routers' auxiliary losses."""
        logits_BSV = self(tokens_BS)
        with region(regions.LOSS):
            lm_loss = self.lm_loss(logits_BSV, targets_BS, fast_cross_entropy(logits_BSV.device))
            aux = sum((m.aux_loss for m in self.moe_layers()), torch.zeros((), device=lm_loss.device))
        return LossParts(total=lm_loss + aux, lm_loss=lm_loss, aux_loss=aux)

    def lm_loss(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """Mean cross-entropy of the logits, in fp32 (a region `train.compile` compiles: fused, the fp32
        upcast of the [B*S, V] logits never reaches memory). `fused` (decided outside, so the region guards on
        it): the Triton op of `trainer/cross_entropy.py`, which reads the logits once each way."""
        return cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten(), fused)
