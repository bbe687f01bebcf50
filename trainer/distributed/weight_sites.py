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
`publish_experts(...)` installs the rowwise values of several experts of one per-expert module at once
(one copy for their data, one for their scales, whatever E: no per-expert loop); `live(site)` reads them
back (digests, checkpoint validation). A param without a module (benchmarks over bare parameters) gets a
site with `module=None`, whose values the site itself holds.

Per-tensor FP8 param gather publishes rowwise only, and each publication installs a NEW `QuantizedTensor`
object (`publish` of a whole weight, or `publish_experts`: a new object over the module's reused rowwise
storage). The columnwise copy built from it at its first backward use (`QuantizedTensor.with_columnwise`)
is cached on that object, so a later gather's values can never be paired with a columnwise copy of older
ones. (Staged storages, mxfp8 and nvfp4, publish both copies quantized at once.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from trainer.precision import QuantizedData, QuantizedTensor, Recipe, Scheme


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
                if fc.grouped_weight:
                    sites.update({w: WeightSite(w, fc, m.recipe) for w in fc.weight_params() if w.requires_grad})
                else:  # the expert index counts frozen experts too: it is the slot in the module's [E, out, in]
                    E = fc.num_experts
                    sites.update({w: WeightSite(w, fc, m.recipe, e, E) for e, w in enumerate(fc.weight_params())
                                  if w.requires_grad})  # fmt: skip
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


def publish_experts(site: WeightSite, experts: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                    scheme: Scheme, recipe: str) -> None:  # fmt: skip
    """Install new rowwise values of the experts `experts` of `site`'s per-expert module, all at once.

    `experts`: int64 expert indices `[n]` (any order, on the data's device); `data`: their FP8 rowwise bytes
    `[n, out, in]` (any strides: a view of the gathered buffer); `scale`: their decode scales, `[n]` per
    tensor or `[n, Mb, Kb]` per 128x128 block. The module's `[E, out, in]` rowwise storage takes them with one
    `index_copy_` each (allocated zero at the first publication; every expert is written before a forward
    reads it, since a module's pre-hook completes the gathers of all its params). The module then holds a NEW rowwise-only QuantizedTensor over
    that storage, so no columnwise copy of the previous values survives (see the module docstring).
    """
    if site.module is None or site.expert is None:
        raise ValueError("publish_experts is for the params of a per-expert layout's module")
    param = site.param
    if tuple(data.shape[1:]) != tuple(param.shape) or not data.shape[0] == experts.numel() == scale.shape[0]:
        raise ValueError(f"{experts.numel()} experts of {tuple(param.shape)} from data {tuple(data.shape)} and "
                         f"scales {tuple(scale.shape)}")  # fmt: skip
    E = site.num_experts
    old = site.module.quantized_weight
    if old is None or old.rowwise is None or old.rowwise.data.dtype != data.dtype:
        rows = QuantizedData(torch.zeros((E, *param.shape), dtype=data.dtype, device=data.device),
                             torch.zeros((E, *scale.shape[1:]), dtype=scale.dtype, device=scale.device))  # fmt: skip
    else:
        rows = old.rowwise
    # uint8 views: the same bytes, and index_copy_ need not support float8 dtypes
    rows.data.view(torch.uint8).index_copy_(0, experts, data.view(torch.uint8))
    rows.scale.index_copy_(0, experts, scale)
    site.module.quantized_weight = QuantizedTensor(scheme, (E, *param.shape), param.dtype, rowwise=rows,
                                                   recipe=recipe)  # fmt: skip


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
