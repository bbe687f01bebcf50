"""MoELayer: router -> dispatch (permute, pad/drop) -> GroupedMLP -> combine, for one decoder layer.

Shape suffixes: B batch, S sequence, D hidden, T = B*S tokens, E experts, P expert-input rows.

After each forward the layer keeps that step's router losses and load, for the model and the metrics:
- `layer.aux_loss`: load-balancing + z-loss of the last forward (fp32 scalar with grad; the model sums it
  into the training loss). `layer.stats` has them apart, with the per-expert token counts.
The tensors are replaced on the next forward, so they hold the last micro-batch's graph until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from moectl.core.config.schema import MoEConfig
from trainer.parallel.groups import Group
from trainer.moe.expert_parallel import build_dispatcher, expert_shard
from trainer.moe.experts import GroupedMLP
from trainer.moe.router import TopKRouter
from trainer import regions
from trainer.precision import Recipe
from trainer.regions import region


@dataclass
class MoEStats:
    """One forward's router losses and load."""

    load_balancing_loss: torch.Tensor  # fp32 scalar with grad, times aux_loss_coeff
    z_loss: torch.Tensor  # fp32 scalar with grad, times z_loss_coeff
    tokens_per_expert_E: torch.Tensor  # int64 routings per expert chosen by the router (before drops)
    num_dropped: torch.Tensor  # int64 scalar: routings dropped by the capacity (0 when dropless)


class MoELayer(nn.Module):
    """The MoE FFN of one layer: submodules `router` (`router.weight`) and `experts` (`experts.linear_fc1...`).

    Args:
        cfg: the `moe` config section.
        hidden_size: D.
        init_std: std of the normal init of the router and the experts.
        output_init_std: std of the experts' fc2 init; None = init_std.
        params_dtype: dtype of the expert parameters (the router weight stays fp32: it scores in fp32).
        generator: RNG for the init (router first, then fc1, then fc2).
        gradient_accumulation_fusion: expert weight grads go straight into `main_grad`.
        align: pad each expert's rows to a multiple of this (the precision recipe's group alignment).
        ep_group: the expert-parallel group; with more than one rank this rank builds only its E/ep experts
            and its dispatcher (`moe.token_dispatcher`) moves tokens to their owners (expert_parallel.py).
        recipe: the low-precision recipe of the experts (None: the params' dtype); `align` must then be a
            multiple of `recipe.align_size`, so no quantization block or kernel tile spans two experts.
        The router stays high precision whatever the recipe (its scores decide routing).
    """

    def __init__(
        self,
        cfg: MoEConfig,
        hidden_size: int,
        *,
        init_std: float = 0.02,
        output_init_std: Optional[float] = None,
        params_dtype: torch.dtype = torch.float32,
        generator: Optional[torch.Generator] = None,
        gradient_accumulation_fusion: bool = False,
        align: int = 1,
        ep_group: Optional[Group] = None,
        recipe: Optional[Recipe] = None,
    ) -> None:
        super().__init__()
        if recipe is not None and align % recipe.align_size:
            raise ValueError(
                f"MoELayer(align={align}) with recipe {recipe.name}: expert segments must be padded to a multiple "
                f"of its align_size {recipe.align_size}; pass align=recipe.align_size"
            )
        self.router = TopKRouter(cfg, hidden_size, init_std, generator)
        self.experts = GroupedMLP(
            cfg, hidden_size, init_std=init_std, output_init_std=output_init_std, params_dtype=params_dtype,
            generator=generator, gradient_accumulation_fusion=gradient_accumulation_fusion, recipe=recipe,
            delay_wgrad=cfg.delay_wgrad_compute, **expert_shard(cfg, ep_group),
        )  # fmt: skip
        # router_padding_for_quantization pads the same way in dispatch (see router.py's docstring)
        self.dispatcher = build_dispatcher(cfg, align=align, ep_group=ep_group)
        self.stats: Optional[MoEStats] = None

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """Route every token to its top-k experts and return the prob-weighted sum of their outputs."""
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        with region(regions.ROUTER):
            routed = self.router(x_TD)
        # delayed wgrad: the dispatcher's backward runs the experts' weight grads while the data grads travel
        flush = self.experts.delayed.flush if self.experts.delayed is not None else None
        if getattr(self.dispatcher, "overlaps", False):  # ep chunks: transfers in flight beside the expert MLP
            with region(regions.DISPATCH), self.experts.chunked(self.dispatcher.chunks):
                y_TD, plan = self.dispatcher.dispatch_compute_combine(x_TD, routed, self._experts_region)
        else:
            with region(regions.DISPATCH):
                x_PD, rows_per_expert_E, probs_P, plan = self.dispatcher.dispatch(x_TD, routed, flush=flush)
            rows_each = self.dispatcher.rows_per_expert(T=B * S, K=routed.indices_TK.shape[1])
            y_PD = self._experts_region(x_PD, rows_per_expert_E, probs_P, rows_each)
            with region(regions.COMBINE):
                y_TD = self.dispatcher.combine(y_PD, plan)
        self.stats = MoEStats(routed.aux_loss, routed.z_loss, routed.tokens_per_expert_E.detach(), plan.num_dropped)
        return y_TD.view(B, S, D)

    def _experts_region(self, x_PD: torch.Tensor, rows_per_expert_E: torch.Tensor, probs_P: torch.Tensor,
                        rows_each: Optional[int]) -> torch.Tensor:  # fmt: skip
        with region(regions.EXPERTS):
            return self.experts(x_PD, rows_per_expert_E, probs_P, rows_each)

    @property
    def aux_loss(self) -> torch.Tensor:
        """Load-balancing loss + z-loss of the last forward (with grad); add it to the training loss."""
        if self.stats is None:
            raise RuntimeError("MoELayer.aux_loss is read before the layer's first forward")
        return self.stats.load_balancing_loss + self.stats.z_loss

    @property
    def tokens_per_expert(self) -> Optional[torch.Tensor]:
        """Routings per expert `[E]` (int64) of the last forward, for load-balance metrics; None before one."""
        return None if self.stats is None else self.stats.tokens_per_expert_E
