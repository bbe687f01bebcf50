"""The seam between the expert MLP and `trainer/precision`: what a backend gets when a recipe is on.

`GroupedMLP(recipe=...)` owns the recipe and the layer's scaling state (delayed scaling's amax
histories). On every call it hands the backend one `ExpertPrecision` as the keyword argument `precision`
of `forward`; backends without a recipe path never see it (`GroupedMLP` refuses them at construction).
A backend runs each of fc1 and fc2 as

    y, saved = qlinear_forward(precision, "fc1", x_TD, w_EOI, groups)   # quantize x and w, fprop
    dx, dw   = qlinear_backward(saved, dy_TO)                            # quantize dy, dgrad + wgrad

with `groups` the token groups of the expert segments (grouped GEMMs, one scale or block set per expert)
or None with a 2-D `[out, in]` weight and `expert=e` (the loop backend's per-expert reference). The
grouped and per-expert forms quantize the same values the same way, so they agree bitwise; that is the
library's guarantee (`trainer/precision/groups.py`), checked end to end in tests/trainer/moe.

Operands are quantized once in forward and kept (quantized) for backward: the rowwise copies feed
fprop, the columnwise ones dgrad (weight) and wgrad (activation). Nothing is re-quantized in backward,
so a stateful recipe records each amax exactly once per step. Weight grads come back in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from trainer.precision import QuantizedTensor, Recipe
from trainer.precision.groups import TokenGroups


@dataclass
class ExpertPrecision:
    """A recipe, the layer's scaling states and what this call needs (see the module docstring).

    states:    recipe states by key ("fc1", "fc2" for grouped GEMMs with one history per expert;
               "fc1.<e>" for the per-expert loop), created on first use. GroupedMLP owns the dict.
    need_grad: whether a backward will follow (quantize the columnwise copies and keep them).
    quantized_weights: "fc1"/"fc2" -> a grouped `[E, out, in]` QuantizedTensor supplied from outside
               (low-precision param gather); used instead of quantizing the high-precision weight.
    uniform_rows: the rows of every expert when the dispatcher pads each to its capacity (None: data
               dependent); the token groups then need no device-to-host read (CUDA graphs).
    """

    recipe: Recipe
    states: dict[str, Any] = field(default_factory=dict)
    need_grad: bool = True
    quantized_weights: dict[str, Optional[QuantizedTensor]] = field(default_factory=dict)
    uniform_rows: Optional[int] = None

    def state(self, fc: str, expert: Optional[int], num_experts: int) -> Any:
        """The scaling state of `fc` (grouped: one entry per expert) or of `fc` for expert `expert` alone."""
        key = fc if expert is None else f"{fc}.{expert}"
        if key not in self.states:
            self.states[key] = self.recipe.new_state(num_experts if expert is None else None)
        return self.states[key]

    def check_aligned(self, tokens_per_expert_E: torch.Tensor) -> None:
        """Every expert segment must be a multiple of the recipe's `align_size` (the dispatcher pads), so no
        quantization block or kernel tile spans two experts. Checked on CPU only (a host sync on CUDA)."""
        align = self.recipe.align_size
        if tokens_per_expert_E.device.type != "cpu" or align <= 1:
            return
        if bool((tokens_per_expert_E % align != 0).any()):
            raise ValueError(
                f"recipe {self.recipe.name} needs every expert's row count to be a multiple of {align}; got "
                f"{tokens_per_expert_E.tolist()}. Pad expert segments in dispatch (MoELayer(align=recipe.align_size))"
            )


@dataclass
class SavedLinear:
    """One linear's quantized operands, kept from forward for backward."""

    recipe: Recipe
    state: Any
    groups: Optional[TokenGroups]
    xq: QuantizedTensor  # columnwise copy only (wgrad)
    wq: QuantizedTensor  # columnwise copy (dgrad)
    x_dtype: torch.dtype


def _weight(p: ExpertPrecision, fc: str, w: torch.Tensor, expert: Optional[int], state: Any) -> QuantizedTensor:
    given = p.quantized_weights.get(fc)
    if given is None:
        return p.recipe.quantize_weight(w, columnwise=p.need_grad, state=state)
    if tuple(given.shape) != tuple(w.shape if expert is None else (given.shape[0], *w.shape)):
        raise ValueError(f"{fc}: quantized weight of shape {tuple(given.shape)} for a weight of {tuple(w.shape)}")
    if p.need_grad and given.columnwise is None and given.scheme.transposable:
        # Per-tensor FP8 param gather publishes rowwise only: build the columnwise copy once, on the published
        # weight itself, where it stays cached for the step's other micro-batches (and for every expert of
        # the loop backend) until the next gather publishes a new weight.
        given.with_columnwise()
    wq = given if expert is None else given.expert(expert)
    if p.need_grad and wq.columnwise is None:
        wq = replace(wq).with_columnwise()  # raises for schemes that need the high-precision source
    return wq


def qlinear_forward(
    p: ExpertPrecision,
    fc: str,
    x_TI: torch.Tensor,
    w: torch.Tensor,
    groups: Optional[TokenGroups],
    *,
    expert: Optional[int] = None,
    amax: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[SavedLinear]]:
    """y `[T, out]` = x times w^T in the recipe: grouped (`w` `[E, out, in]`, `groups`) or one expert's
    `[out, in]` weight (`expert` = its index, `groups` None). Returns y in x's dtype and what backward needs
    (None when `p.need_grad` is off)."""
    recipe = p.recipe
    num_experts = w.shape[0] if groups is not None else 1
    state = p.state(fc, expert, num_experts)
    wq = _weight(p, fc, w, expert, state)
    # amax: x's per-group amax, measured by its producer (only for recipes that take it: see backends/fused.py)
    extra = {} if amax is None else {"amax": amax}
    xq = recipe.quantize_activation(x_TI, groups=groups, columnwise=p.need_grad, state=state, **extra)
    if groups is None and x_TI.shape[0] == 0:  # an expert without rows: nothing to multiply (no kernel call)
        y = x_TI.new_zeros(0, w.shape[-2])
    elif groups is None:
        y = recipe.fprop(xq, wq, x_TI.dtype)
    else:
        y = recipe.grouped_fprop(xq, wq, x_TI.dtype)
    if not p.need_grad:
        return y, None
    # only the columnwise copies are read from here on: drop the rowwise bytes now
    xq = replace(xq, rowwise=None)
    wq = replace(wq, rowwise=None)
    return y, SavedLinear(recipe, state, groups, xq, wq, x_TI.dtype)


def quantize_output_grad(s: SavedLinear, dy_TO: torch.Tensor, amax: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """The output grad in the recipe (both copies: rowwise for dgrad, columnwise for wgrad); `amax` as in
    `qlinear_forward`. The first step of `qlinear_backward`, public for backends that schedule the two GEMMs
    themselves (the fused backend runs the weight grad on a side stream)."""
    extra = {} if amax is None else {"amax": amax}
    return s.recipe.quantize_grad(
        dy_TO.contiguous(), groups=s.groups, rowwise=True, columnwise=True, state=s.state, **extra
    )  # fmt: skip


def qlinear_dgrad(
    s: SavedLinear, dy_TO: torch.Tensor, amax: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, QuantizedTensor]:
    """(dx `[T, in]` in x's dtype, the quantized output grad for `qlinear_wgrad`): the data half of
    `qlinear_backward`. The grad is quantized here, so a stateful recipe records its amax at the same
    point whether the weight grad follows at once or later (delayed wgrad)."""
    gq = quantize_output_grad(s, dy_TO, amax)
    if s.groups is None and dy_TO.shape[0] == 0:
        return dy_TO.new_zeros(0, s.wq.shape[-1], dtype=s.x_dtype), gq
    if s.groups is None:
        return s.recipe.dgrad(gq, s.wq, s.x_dtype), gq
    return s.recipe.grouped_dgrad(gq, s.wq, s.x_dtype), gq


def qlinear_wgrad(s: SavedLinear, gq: QuantizedTensor) -> torch.Tensor:
    """dW fp32 `[E, out, in]` or `[out, in]` from the output grad `qlinear_dgrad` quantized."""
    if s.groups is None and gq.shape[0] == 0:
        return torch.zeros(s.wq.shape, dtype=torch.float32, device=gq.device)
    if s.groups is None:
        return s.recipe.wgrad(gq, s.xq)
    return s.recipe.grouped_wgrad(gq, s.xq)


def qlinear_backward(
    s: SavedLinear, dy_TO: torch.Tensor, amax: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx `[T, in]` in x's dtype, dW fp32 `[E, out, in]` or `[out, in]`) from the output grad."""
    dx, gq = qlinear_dgrad(s, dy_TO, amax)
    return dx, qlinear_wgrad(s, gq)
