"""`Linear`: the transformer block's linear layer (attention `linear_qkv`/`linear_proj`, the dense MLP),
run through a low-precision recipe when one is given.

It is an `nn.Linear` (same `weight`/`bias` parameters, state-dict keys and default init), so models and
checkpoints do not change with the recipe:

    recipe None   F.linear(x, weight, bias), bitwise what nn.Linear computes; under
                  `gradient_accumulation_fusion` the weight grad is accumulated in fp32 straight into
                  `weight.main_grad` inside the GEMM (`main_grad.accumulate_wgrad_mm`), no bf16 `.grad`
    recipe set    recipe.linear(x, weight, param=weight, fuse_wgrad=..., state=...) (+ bias in x's dtype):
                  x, weight and the output grad quantized, fprop/dgrad/wgrad native or emulated
                  (trainer/precision/linear.py); the weight grad is fp32, into `weight.main_grad` under
                  `gradient_accumulation_fusion`, else to autograd (cast to the weight's dtype)

The module owns the recipe's scaling state (`recipe_state`: delayed scaling's amax histories; None for
the stateless recipes). A forward without grad (eval) quantizes with a copy of that state, so evaluating
never moves the histories training sees (train-eval-train equals train-only).

Low-precision param gather hook: `quantized_weight`. When it holds a `QuantizedTensor` of the recipe (e.g.
the weight's fp8 bytes after an all-gather), forward uses it instead of quantizing `weight`, and the weight
grad still goes to `weight` (main_grad or .grad). `weight` then keeps only what the optimizer needs from it:
its shape, identity and `main_grad`; its values are not read. Whoever sets `quantized_weight` keeps it
current (re-sets it after every gather) and clears it (None) to go back to quantizing `weight`. Backward
needs the columnwise copy: it is built from the rowwise one for per-tensor and square-tile weights
(tensorwise, delayed, blockwise, nvfp4); rowwise and mxfp8 weights must come with both copies.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from trainer.main_grad import accumulate_wgrad_mm, require_main_grad
from trainer.precision import QuantizedTensor, Recipe


def state_for_call(state: Any, need_grad: bool) -> Any:
    """The recipe state a forward may update: the layer's own when a backward follows (`need_grad`), else a
    copy, so that eval does not record amaxes into the histories training reads. Experts use it too."""
    return state if need_grad else copy.deepcopy(state)


class Linear(nn.Linear):
    """`nn.Linear` whose GEMMs run in `recipe` (see the module docstring).

    Args:
        in_features, out_features: as nn.Linear.
        bias: add a bias (high precision, after the quantized GEMM).
        dtype, device: of the parameters.
        recipe: a `trainer.precision.Recipe`, or None for plain `F.linear`.
        gradient_accumulation_fusion: with a recipe, add the fp32 weight grad to `weight.main_grad` (which
            must exist: `trainer.main_grad.attach_main_grads` or the distributed buffers) instead of `.grad`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
        recipe: Optional[Recipe] = None,
        gradient_accumulation_fusion: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.recipe_state: Any = recipe.new_state() if recipe is not None else None
        self.quantized_weight: Optional[QuantizedTensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recipe is None:
            if self.quantized_weight is not None:
                raise RuntimeError("Linear.quantized_weight is set but the layer has no recipe to run it")
            if self.gradient_accumulation_fusion and torch.is_grad_enabled() and self.weight.requires_grad:
                y = _FusedWgradLinear.apply(x, self.weight)
                return y if self.bias is None else y + self.bias
            return F.linear(x, self.weight, self.bias)
        w: torch.Tensor | QuantizedTensor = self.weight
        if self.quantized_weight is not None:
            if tuple(self.quantized_weight.shape) != tuple(self.weight.shape):
                raise ValueError(
                    f"quantized_weight of shape {tuple(self.quantized_weight.shape)} for a weight of "
                    f"{tuple(self.weight.shape)}"
                )
            w = self.quantized_weight
        need_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        state = state_for_call(self.recipe_state, need_grad)
        y = self.recipe.linear(x, w, param=self.weight, fuse_wgrad=self.gradient_accumulation_fusion, state=state)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", recipe={self.recipe.name}" if self.recipe is not None else "")


class _FusedWgradLinear(torch.autograd.Function):
    """y = x W^T; backward: dx = dy W, and dW accumulated into `W.main_grad` in fp32 (no autograd grad)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: nn.Parameter) -> torch.Tensor:
        require_main_grad(weight)
        ctx.save_for_backward(x)
        ctx.weight = weight
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        accumulate_wgrad_mm(weight, dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]))
        return dx, None
