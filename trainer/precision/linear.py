"""Autograd functions for linear and grouped linear layers in a low-precision recipe.

Forward quantizes the activation (rowwise, plus columnwise when the weight needs a grad) and the weight
(rowwise, plus columnwise when x needs a grad) and runs fprop; backward quantizes the output grad
(rowwise for dgrad, columnwise for wgrad; e5m2 under `hybrid`) and runs

    dgrad = dy x W        (W's columnwise copy)        -> dx in x's dtype
    wgrad = dy^T x x      (columnwise copies of both)  -> dW in fp32

as TE's Linear/GroupedLinear do. Quantized operands are kept on `ctx` between forward and backward (they
are not tensors autograd can save; saved-tensor hooks do not see them).

Weight grads: dW is fp32 (bf16 from the native grouped kernel, whose output it is: native.py). With
`fuse_wgrad=True` it is added to `param.main_grad` (fp32) through
`trainer.main_grad.accumulate_wgrad` (which also fires the param's grad-ready hook) and autograd gets no
grad for the weight; otherwise autograd receives it (and casts it to the weight's dtype).

A weight may be given already quantized (a `QuantizedTensor`: the fp8/fp4-param path, where the model
keeps no high-precision copy). Its grad then goes to `param` (one tensor of the weight's shape, or a
list of E per-expert `[out, in]` tensors for a grouped weight): into main_grad when fused, else as
autograd grads of `param`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from ..main_grad import accumulate_wgrad
from .groups import TokenGroups
from .quantized_tensor import QuantizedTensor

if TYPE_CHECKING:
    from .recipes.base import Recipe

Owners = Union[torch.Tensor, Sequence[torch.Tensor], None]


def _owners_and_anchors(w: Union[torch.Tensor, QuantizedTensor], param: Owners) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """Owners get main_grad; anchors are the tensors autograd routes the weight grad to."""
    if isinstance(param, torch.Tensor):
        owners = [param]
    elif param is None:
        owners = [w] if isinstance(w, torch.Tensor) else []
    else:
        owners = list(param)
    anchors = (w,) if isinstance(w, torch.Tensor) else tuple(owners)
    return owners, anchors


def _route_wgrad(dw: torch.Tensor, owners: list[torch.Tensor], n_anchors: int, fuse: bool) -> tuple[Optional[torch.Tensor], ...]:
    """Split dW over owners (one, or one per expert) and turn it into autograd grads for the anchors."""
    if len(owners) == 1:
        parts = [dw]
    elif len(owners) == dw.shape[0] and dw.dim() == 3:
        parts = list(dw.unbind(0))
    else:
        raise ValueError(f"{len(owners)} weight owners for a weight grad of shape {tuple(dw.shape)}")
    for owner, part in zip(owners, parts):
        if tuple(owner.shape) != tuple(part.shape):
            raise ValueError(f"weight owner of shape {tuple(owner.shape)} for a grad of shape {tuple(part.shape)}")
    if fuse:
        for owner, part in zip(owners, parts):
            accumulate_wgrad(owner, part, True)  # type: ignore[arg-type]
        return tuple(None for _ in range(n_anchors))
    if n_anchors == len(parts):
        return tuple(parts)
    # one anchor (the weight tensor) but per-expert owners: the anchor takes the whole grad
    return (dw,)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, recipe: "Recipe", qweight: Optional[QuantizedTensor], grouped: Optional[TokenGroups],
                state: Any, fuse: bool, owners: list, grad_on: bool, *anchors: torch.Tensor) -> torch.Tensor:
        need_dgrad = grad_on and x.requires_grad
        need_wgrad = grad_on and any(a.requires_grad for a in anchors)
        if qweight is None:
            wq = recipe.quantize_weight(anchors[0], columnwise=need_dgrad, state=state)
        else:
            wq = qweight
            if need_dgrad and wq.columnwise is None:
                wq = wq.with_columnwise()  # raises for schemes that need the high-precision source
        xq = recipe.quantize_activation(x, groups=grouped, columnwise=need_wgrad, state=state)
        if grouped is None:
            y = recipe.fprop(xq, wq, x.dtype)
        else:
            y = recipe.grouped_fprop(xq, wq, x.dtype)
        ctx.recipe, ctx.state, ctx.fuse, ctx.owners, ctx.grouped = recipe, state, fuse, owners, grouped
        ctx.wq = wq if need_dgrad else None
        ctx.xq = xq if need_wgrad else None
        ctx.need = (need_dgrad, need_wgrad)
        ctx.x_dtype = x.dtype
        ctx.n_anchors = len(anchors)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        need_dgrad, need_wgrad = ctx.need
        recipe, grouped = ctx.recipe, ctx.grouped
        dx = None
        anchor_grads: tuple[Optional[torch.Tensor], ...] = tuple(None for _ in range(ctx.n_anchors))
        if need_dgrad or need_wgrad:
            gq = recipe.quantize_grad(
                dy.contiguous(), groups=grouped, rowwise=need_dgrad, columnwise=need_wgrad, state=ctx.state
            )
            if need_dgrad:
                dx = (recipe.dgrad if grouped is None else recipe.grouped_dgrad)(gq, ctx.wq, ctx.x_dtype)
            if need_wgrad:
                dw = (recipe.wgrad if grouped is None else recipe.grouped_wgrad)(gq, ctx.xq)
                anchor_grads = _route_wgrad(dw, ctx.owners, ctx.n_anchors, ctx.fuse)
        ctx.wq = ctx.xq = None  # free the quantized operands now
        return (dx, None, None, None, None, None, None, None, *anchor_grads)


def linear(
    recipe: "Recipe",
    x: torch.Tensor,
    w: Union[torch.Tensor, QuantizedTensor],
    *,
    param: Owners = None,
    fuse_wgrad: bool = False,
    state: Any = None,
) -> torch.Tensor:
    """y `[..., out]` = x `[..., in]` @ w `[out, in]`^T with every GEMM in `recipe`.

    w:          the high-precision weight (quantized here, every call) or a QuantizedTensor.
    param:      who owns the weight grad (default: `w` when it is a tensor); see the module docstring.
    fuse_wgrad: add the fp32 weight grad to `param.main_grad` instead of returning it to autograd.
    state:      the layer's recipe state (`recipe.new_state()`; needed by `delayed`).
    """
    if w.shape[-1] != x.shape[-1] or len(w.shape) != 2:
        raise ValueError(f"linear: weight of shape {tuple(w.shape)} for input of shape {tuple(x.shape)}")
    owners, anchors = _owners_and_anchors(w, param)
    qweight = w if isinstance(w, QuantizedTensor) else None
    x2d = x.reshape(-1, x.shape[-1])
    y = _Linear.apply(x2d, recipe, qweight, None, state, fuse_wgrad, owners, torch.is_grad_enabled(), *anchors)
    return y.reshape(*x.shape[:-1], w.shape[0])


def grouped_linear(
    recipe: "Recipe",
    x: torch.Tensor,
    w: Union[torch.Tensor, QuantizedTensor],
    offs: torch.Tensor,
    *,
    param: Owners = None,
    fuse_wgrad: bool = False,
    state: Any = None,
) -> torch.Tensor:
    """y `[T, out]`: the rows of expert e (rows offs[e-1]..offs[e] of x `[T, in]`) times w[e]^T,
    w `[E, out, in]`. Every expert's token count must be a multiple of `recipe.align_size` (the
    dispatcher pads), so that no quantization block or kernel tile spans two experts.

    `param` may be the single `[E, out, in]` parameter or the list of E per-expert `[out, in]` parameters
    (per-expert layout); other arguments as in `linear`.
    """
    if x.dim() != 2 or len(w.shape) != 3 or w.shape[-1] != x.shape[-1]:
        raise ValueError(f"grouped_linear: weight of shape {tuple(w.shape)} for input of shape {tuple(x.shape)}")
    if offs.numel() != w.shape[0]:
        raise ValueError(f"grouped_linear: {offs.numel()} offsets for {w.shape[0]} experts")
    groups = TokenGroups.from_offsets(offs, x.shape[0], validate=offs.device.type == "cpu")
    owners, anchors = _owners_and_anchors(w, param)
    qweight = w if isinstance(w, QuantizedTensor) else None
    return _Linear.apply(x, recipe, qweight, groups, state, fuse_wgrad, owners, torch.is_grad_enabled(), *anchors)
