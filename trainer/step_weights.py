"""Low-precision weights quantized once per optimizer step, not once per micro-batch.

A weight does not change between the micro-batches of a step, yet a recipe layer quantized it (both copies)
in every forward: on the reference model under fp8 e4m3, an H100, 3 of every 4 weight quantizations were
repeats (quantize 38.8 ms of a 268.6 ms step; 26.4 ms quantized once per step: docs/benchmarks.md, twelfth
session). TransformerEngine caches its fp8 weights after the first micro-batch for the same reason.

`StepWeights.publish()` quantizes every recipe layer's weight once and installs it through the layers'
`quantized_weight` hook (the one low-precision param gather publishes through); `retract()` clears it. The
loop publishes right after launching an update (the quantization queues behind it while the host reads the
step's record; at the step's start it idled the device ~8 ms) and retracts after the next step's last
backward, before that update: between two updates the weights do not change, so every forward in between
(micro-batches, evaluation, the checkpoint probe) reads current values, the ones it would have computed
itself: training is bitwise unchanged. Under CUDA graphs the published weights are pinned by
`StaticWeights` like param gather's, outside the graph, and the captured forward reads them: no
quantization is captured. Transposable schemes are published rowwise only: the columnwise copy is built
from those bytes where it is first needed (once per step: the pinned copy, or cached on the published
weight), not quantized a second time.

Only stateless recipes take part: delayed scaling records every weight quantization's amax in its history,
and publishing once would record a quarter of them. Not with fp8 param gather (it publishes its own), nor
the `te` expert backend (TE quantizes its weights itself).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from trainer.linear import Linear
from trainer.moe.experts import GroupedMLP
from trainer.precision import Recipe

Site = tuple[nn.Module, Recipe, Callable[[], torch.Tensor]]


def _sites(model: nn.Module) -> list[Site]:
    """(module with the `quantized_weight` hook, its recipe, the high-precision weight it quantizes) for every
    layer with a stateless recipe."""
    sites: list[Site] = []
    for m in model.modules():
        # (the `te` expert backend quantizes its weights inside TE and refuses supplied ones: MOE062)
        if isinstance(m, GroupedMLP) and m.recipe is not None and m.recipe.new_state() is None and m.backend_name != "te":
            for lin in (m.linear_fc1, m.linear_fc2):
                sites.append((lin, m.recipe, lambda lin=lin: lin.as_grouped(lin.weight_params(), lin.grouped_weight)))
        elif isinstance(m, Linear) and m.recipe is not None and m.recipe.new_state() is None:
            sites.append((m, m.recipe, lambda m=m: m.weight))
    return sites


class StepWeights:
    """The model's recipe weights, quantized once per step (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.sites = _sites(model)
        self.published: list[nn.Module] = []

    @torch.no_grad()
    def publish(self) -> int:
        """Quantize each weight and install it; returns how many. Call when the params are current (after the
        param gather) and retract before they change."""
        for module, recipe, weight in self.sites:
            if module.quantized_weight is None:
                columnwise = not recipe.weight_scheme().transposable
                module.quantized_weight = recipe.quantize_weight(weight(), columnwise=columnwise)
                self.published.append(module)
        return len(self.published)

    def retract(self) -> None:
        """Clear what `publish` installed (after the step's last backward, before the update)."""
        for module in self.published:
            module.quantized_weight = None
        self.published = []
