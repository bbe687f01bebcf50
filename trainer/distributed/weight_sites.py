"""Where a quantized weight is used: the model side of low-precision param gather.

A *site* ties one weight parameter to the module that runs it through a recipe and reads an externally
supplied quantized weight from its `quantized_weight` attribute (the documented hook of
`trainer.linear.Linear` and of `trainer.moe.experts.GroupedLinearParams`):

    Linear (attention linear_qkv / linear_proj, dense MLP fc1 / fc2)  weight [out, in]      expert None
    GroupedLinearParams, single grouped layout                         weight [E, out, in]   expert None
    GroupedLinearParams, per-expert layout                             weight{e} [out, in]   expert e

The per-expert layout's module reads one `[E, out, in]` QuantizedTensor: each expert param's values are
written into its slice (`QuantizedTensor.expert(e)` views) in place. Embedding, output head, norms,
routers and biases have no site: they stay high precision (TE/Megatron do the same).

`find_sites(model)` lists them; `publish(site, qt)` installs a param's new quantized values;
`live(site)` reads them back (digests, checkpoint validation). A param without a module (benchmarks over
bare parameters) gets a site with `module=None`, whose values the site itself holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from trainer.precision import QuantizedTensor, Recipe


@dataclass(eq=False)
class WeightSite:
    """One weight param's place in the model (see the module docstring)."""

    param: nn.Parameter
    module: Optional[nn.Module]
    recipe: Optional[Recipe]
    expert: Optional[int] = None  # the expert index of a per-expert param inside its module's [E, out, in]
    num_experts: int = 1  # E of the module's quantized weight (per-expert layout), else 1
    _own: Optional[QuantizedTensor] = field(default=None, repr=False)  # module-less sites

    @property
    def owner(self) -> object:
        """What shares one delayed-scaling history: the module (all experts of a layout), else the param."""
        return self.module if self.module is not None else self.param


def find_sites(model: nn.Module) -> dict[nn.Parameter, WeightSite]:
    """Every trainable weight the model runs through a recipe, with its module (see the module docstring)."""
    from trainer.linear import Linear
    from trainer.moe.experts import GroupedMLP

    sites: dict[nn.Parameter, WeightSite] = {}
    for m in model.modules():
        if isinstance(m, Linear) and m.recipe is not None and m.weight.requires_grad:
            sites[m.weight] = WeightSite(m.weight, m, m.recipe)
        elif isinstance(m, GroupedMLP) and m.recipe is not None:
            for fc in (m.linear_fc1, m.linear_fc2):
                weights = [w for w in fc.weight_params() if w.requires_grad]
                if fc.grouped_weight:
                    sites.update({w: WeightSite(w, fc, m.recipe) for w in weights})
                else:
                    E = fc.num_experts
                    sites.update({w: WeightSite(w, fc, m.recipe, e, E) for e, w in enumerate(weights)})
    return sites


def publish(site: WeightSite, qt: QuantizedTensor) -> None:
    """Make `qt` (the param's whole quantized value, rowwise and columnwise) what the forward uses."""
    if tuple(qt.shape) != tuple(site.param.shape):
        raise ValueError(f"quantized value of shape {tuple(qt.shape)} for a param of {tuple(site.param.shape)}")
    if site.module is None:
        site._own = qt
        return
    if site.expert is None:
        site.module.quantized_weight = qt
        return
    grouped = site.module.quantized_weight
    if grouped is None:
        # First publish: allocate the module's [E, out, in] weight; every expert is written before any
        # forward reads it (a module's pre-hook completes the gathers of all its params).
        grouped = QuantizedTensor.stack([qt] * site.num_experts)
        site.module.quantized_weight = grouped
    grouped.expert(site.expert).copy_(qt)


def live(site: WeightSite) -> Optional[QuantizedTensor]:
    """The param's current quantized value (None before the first gather)."""
    if site.module is None:
        return site._own
    qt = site.module.quantized_weight
    if qt is None or site.expert is None:
        return qt
    return qt.expert(site.expert)


def placeholder(param: torch.Tensor) -> torch.Tensor:
    """What a quantized param's `.data` becomes: its shape and dtype over ONE element, NaN.

    The model keeps no high-precision copy; layers read only the param's shape, identity and `main_grad`.
    A stray read of the values gives NaN (loud), and a write raises (all elements share one location).
    """
    return torch.full((), float("nan"), dtype=param.dtype, device=param.device).expand(param.shape)


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether `t` holds no values of its own (one element, broadcast to its shape)."""
    return t.untyped_storage().nbytes() <= t.element_size() and t.numel() > 1
