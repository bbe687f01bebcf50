"""Top-k token-choice router: scores, top-k, load-balancing aux loss and z-loss, all in fp32.

Shape suffixes: T tokens, D hidden size, E experts, K experts per token (top-k).

Scores: `softmax` takes the top-k of the softmax over all experts and renormalises them only with
`router_norm_topk_prob` (Mixtral/Qwen3 do, Switch does not). `sigmoid` scores each expert independently and
renormalises the chosen k to sum to 1, as DeepSeek-V3 does (Megatron too); with k = 1 it keeps the raw score,
because a renormalised single prob is always 1 and the router would get no gradient from the main loss.

Losses come back as tensors with grad; the caller adds them to the loss (`MoELayer.aux_loss`):
- load balancing (Switch/GShard, as Megatron's `switch_load_balancing_loss_func`):
  `coeff * E * sum_e f_e * P_e`, f_e = share of the T*K routings that went to e (no grad),
  P_e = mean over tokens of the full score distribution (softmax, or sigmoid scores normalised over E).
  A perfectly balanced router gives `coeff * 1`.
- z-loss (ST-MoE): `coeff * mean_t logsumexp(logits_t)^2`; keeps logits small so softmax stays well-conditioned.

`router_padding_for_quantization` is not done here: on one device, padding each expert's count with prob-0
routings is numerically the same as the dispatcher's alignment padding, which `LocalDispatcher` does. It
matters only to size expert-parallel all-to-alls, and belongs with that dispatcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from moectl.core.config.schema import MoEConfig
from trainer.init_weights import normal_
from trainer.moe.router_gemm import router_logits
from trainer.moe.router_topk import fast_topk, topk


@dataclass
class RouterOutput:
    """What the router decided for T tokens."""

    probs_TK: torch.Tensor  # fp32 routing weights of the chosen experts (with grad)
    indices_TK: torch.Tensor  # int64 expert ids, best first
    tokens_per_expert_E: torch.Tensor  # int64 routings per expert (before any capacity drop); no grad
    aux_loss: torch.Tensor  # fp32 scalar, already times aux_loss_coeff (0 when disabled)
    z_loss: torch.Tensor  # fp32 scalar, already times z_loss_coeff (0 when disabled)


def load_balancing_loss(
    scores_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor, topk: int, coeff: float
) -> torch.Tensor:
    """Switch/GShard aux loss `coeff * E * sum_e f_e * P_e` (see the module docstring); grad flows via P."""
    T, E = scores_TE.shape
    f_E = tokens_per_expert_E.to(scores_TE.dtype) / (T * topk)
    P_E = scores_TE.mean(dim=0)
    return coeff * E * torch.sum(f_E * P_E)


def z_loss(logits_TE: torch.Tensor, coeff: float) -> torch.Tensor:
    """Router z-loss `coeff * mean(logsumexp(logits)^2)`."""
    return coeff * torch.logsumexp(logits_TE, dim=-1).square().mean()


def expert_counts(indices_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routings per expert `[E]` (int64): exact, deterministic, and without a host sync. `torch.bincount`
    reads its input's max on the host on CUDA, which a CUDA graph cannot capture; a comparison with every
    expert id and an integer sum do not, and a compiled router fuses them into one reduction."""
    ids_E = torch.arange(num_experts, device=indices_TK.device)
    return (indices_TK.reshape(-1, 1) == ids_E).sum(dim=0)


class TopKRouter(nn.Module):
    """Linear gate `[E, D]` (state-dict key `weight`) and top-k selection, computed in fp32."""

    def __init__(
        self, cfg: MoEConfig, hidden_size: int, init_std: float, generator: Optional[torch.Generator] = None
    ) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.topk = cfg.router_topk
        self.score_function = cfg.router_score_function
        self.norm_topk_prob = cfg.router_norm_topk_prob
        self.aux_loss_coeff = cfg.aux_loss_coeff
        self.z_loss_coeff = cfg.z_loss_coeff
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"router_topk ({self.topk}) must be in [1, num_experts={self.num_experts}]")
        device = generator.device if generator is not None else None
        weight = torch.empty(cfg.num_experts, hidden_size, dtype=torch.float32, device=device)
        self.weight = nn.Parameter(normal_(weight, init_std, generator))

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        """Route `x_TD` (any float dtype) to its top-k experts."""
        # fp32 logits: bf16 scores tie and flip top-k choices, and the aux losses need the precision
        return self.route(router_logits(x_TD, self.weight), fast_topk(x_TD.device))

    def route(self, logits_TE: torch.Tensor, fast: bool = False) -> RouterOutput:
        """Scores, top-k and the auxiliary losses from the fp32 logits `[T, E]` (`train.compile` compiles this
        part; the logits' GEMM is `router_gemm.router_logits`, tensor-core GEMMs on CUDA). `fast`: the top-k
        ids from the Triton kernel (`router_topk.py`; decided by the caller, outside any compiled region)."""
        if self.score_function == "softmax":
            scores_TE = torch.softmax(logits_TE, dim=-1)
            probs_TK, indices_TK = topk(scores_TE, self.topk, fast)
            if self.norm_topk_prob:
                probs_TK = probs_TK / probs_TK.sum(dim=-1, keepdim=True)
            aux_scores_TE = scores_TE
        else:
            scores_TE = torch.sigmoid(logits_TE)
            probs_TK, indices_TK = topk(scores_TE, self.topk, fast)
            if self.topk > 1:
                probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + 1e-20)
            aux_scores_TE = scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)

        tokens_per_expert_E = expert_counts(indices_TK, self.num_experts)
        zero = logits_TE.new_zeros(())
        aux = (
            load_balancing_loss(aux_scores_TE, tokens_per_expert_E, self.topk, self.aux_loss_coeff)
            if self.aux_loss_coeff > 0
            else zero
        )
        zl = z_loss(logits_TE, self.z_loss_coeff) if self.z_loss_coeff > 0 else zero
        return RouterOutput(probs_TK, indices_TK, tokens_per_expert_E, aux, zl)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, topk={self.topk}, score={self.score_function}"
