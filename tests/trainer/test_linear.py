"""`trainer.linear.Linear`: bitwise nn.Linear without a recipe, bitwise `recipe.linear` with one; the
main_grad route, eval leaving delayed scaling's state alone, and the quantized-weight hook."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trainer.linear import Linear
from trainer.main_grad import attach_main_grads
from trainer.precision import (
    BlockwiseRecipe,
    DelayedRecipe,
    MXFP8Recipe,
    NVFP4Recipe,
    Recipe,
    RowwiseRecipe,
    TensorwiseRecipe,
)

RECIPES = {
    "tensorwise": lambda: TensorwiseRecipe(),
    "tensorwise-hybrid": lambda: TensorwiseRecipe("hybrid"),
    "delayed": lambda: DelayedRecipe(),
    "rowwise": lambda: RowwiseRecipe(),
    "blockwise": lambda: BlockwiseRecipe(),
    "mxfp8": lambda: MXFP8Recipe(),
    "nvfp4": lambda: NVFP4Recipe(None),
}
IN, OUT = 64, 32


def inputs(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, IN, generator=g).to(dtype)
    dy = torch.randn(2, 16, OUT, generator=g).to(dtype)
    return x, dy


def fwd_bwd(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_without_recipe_is_nn_linear_bitwise(dtype: torch.dtype, bias: bool) -> None:
    torch.manual_seed(3)
    ref = nn.Linear(IN, OUT, bias=bias, dtype=dtype)
    after_ref = torch.rand(3)
    torch.manual_seed(3)
    lin = Linear(IN, OUT, bias=bias, dtype=dtype)
    after_lin = torch.rand(3)
    # same parameters, keys and init, and the same draws from the global RNG (later draws do not move)
    assert list(lin.state_dict()) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(lin.state_dict()[k], v), k
    assert torch.equal(after_lin, after_ref)
    x, dy = inputs(dtype)
    for a, b in zip(fwd_bwd(lin, x, dy), fwd_bwd(ref, x, dy)):
        assert torch.equal(a, b)
    assert torch.equal(lin.weight.grad, ref.weight.grad)
    if bias:
        assert torch.equal(lin.bias.grad, ref.bias.grad)


def weights(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(OUT, IN, generator=g) * 0.1).to(dtype), (torch.randn(OUT, generator=g) * 0.1).to(dtype)


def recipe_layer(recipe: Recipe, dtype: torch.dtype, bias: bool = False, fuse: bool = False) -> Linear:
    lin = Linear(IN, OUT, bias=bias, dtype=dtype, recipe=recipe, gradient_accumulation_fusion=fuse)
    w, b = weights(dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias:
            lin.bias.copy_(b)
    return lin


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_recipe_is_recipe_linear_bitwise(name: str, dtype: torch.dtype) -> None:
    recipe = RECIPES[name]()
    lin = recipe_layer(recipe, dtype, bias=True)
    x, dy = inputs(dtype)
    y, dx = fwd_bwd(lin, x, dy)

    w_ref, b_ref = weights(dtype)
    w_ref.requires_grad_()
    x_ref = x.clone().requires_grad_()
    y_ref = recipe.linear(x_ref, w_ref, state=recipe.new_state()) + b_ref
    y_ref.backward(dy)
    assert y.dtype == dtype and lin.weight.grad.dtype == dtype
    assert torch.equal(y, y_ref.detach())
    assert torch.equal(dx, x_ref.grad)
    assert torch.equal(lin.weight.grad, w_ref.grad)
    assert torch.equal(lin.bias.grad, dy.sum((0, 1)))
    # and the recipe really ran: not the high-precision product
    assert not torch.equal(y, torch.nn.functional.linear(x, w_ref.detach(), b_ref))


@pytest.mark.parametrize("name", ["tensorwise", "mxfp8", "nvfp4"])
def test_gradient_accumulation_fusion_adds_fp32_wgrad_to_main_grad(name: str) -> None:
    x, dy = inputs()
    plain = recipe_layer(RECIPES[name](), torch.float32)
    fwd_bwd(plain, x, dy)
    fused = recipe_layer(RECIPES[name](), torch.float32, fuse=True)
    attach_main_grads(fused)
    for _ in range(2):
        fwd_bwd(fused, x, dy)
    assert fused.weight.grad is None
    assert torch.equal(fused.weight.main_grad, 2 * plain.weight.grad)


def test_fusion_without_main_grad_says_how_to_fix() -> None:
    lin = recipe_layer(TensorwiseRecipe(), torch.float32, fuse=True)
    with pytest.raises(RuntimeError, match="attach_main_grads"):
        fwd_bwd(lin, *inputs())


def test_eval_does_not_move_delayed_scaling_state() -> None:
    x, dy = inputs()
    x2, dy2 = inputs(seed=5)
    ref, lin = recipe_layer(DelayedRecipe(), torch.float32), recipe_layer(DelayedRecipe(), torch.float32)
    fwd_bwd(ref, x, dy)
    fwd_bwd(lin, x, dy)
    before = copy.deepcopy(lin.recipe_state)
    with torch.no_grad():
        lin(x2 * 100)  # an eval batch with a much larger amax
    for role in ("input", "weight", "grad"):
        assert torch.equal(getattr(lin.recipe_state, role).history, getattr(before, role).history), role
    # train-eval-train equals train-train
    for a, b in zip(fwd_bwd(lin, x2, dy2), fwd_bwd(ref, x2, dy2)):
        assert torch.equal(a, b)
    # while a training step does record (the histories are live)
    assert not torch.equal(lin.recipe_state.input.history, before.input.history)


@pytest.mark.parametrize("name", ["tensorwise", "delayed", "nvfp4", "mxfp8"])
def test_quantized_weight_hook_replaces_quantizing_the_weight(name: str) -> None:
    x, dy = inputs()
    ref = recipe_layer(RECIPES[name](), torch.float32)
    y_ref, dx_ref = fwd_bwd(ref, x, dy)
    lin = recipe_layer(RECIPES[name](), torch.float32)
    # per-tensor and square-tile weights may come rowwise only (the columnwise copy is their transpose)
    both = name == "mxfp8"
    lin.quantized_weight = lin.recipe.quantize_weight(
        lin.weight.detach(), columnwise=both, state=lin.recipe.new_state()
    )
    with torch.no_grad():
        lin.weight.zero_()  # its values are no longer read; its grad still lands on it
    y, dx = fwd_bwd(lin, x, dy)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert torch.equal(lin.weight.grad, ref.weight.grad)
    lin.quantized_weight = None  # back to quantizing the (now zero) weight
    assert torch.equal(lin(x), torch.zeros_like(y))


def test_quantized_weight_hook_checks_shape_and_recipe() -> None:
    lin = recipe_layer(TensorwiseRecipe(), torch.float32)
    lin.quantized_weight = TensorwiseRecipe().quantize_weight(torch.randn(OUT, IN + 16))
    with pytest.raises(ValueError, match="quantized_weight of shape"):
        lin(inputs()[0])
    plain = Linear(IN, OUT)
    plain.quantized_weight = TensorwiseRecipe().quantize_weight(torch.randn(OUT, IN))
    with pytest.raises(RuntimeError, match="no recipe"):
        plain(inputs()[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_wgrad_without_recipe_accumulates_fp32_products(dtype: torch.dtype) -> None:
    """No recipe, `gradient_accumulation_fusion`: dW goes into main_grad as the fp32 product of the operands
    (never rounded to the param dtype), twice over two micro-batches; dx is F.linear's; .grad stays None."""
    x, dy = (t.to(dtype) for t in inputs())
    lin = Linear(IN, OUT, dtype=dtype, gradient_accumulation_fusion=True)
    attach_main_grads(lin)
    ref = nn.Linear(IN, OUT, bias=False, dtype=dtype)
    ref.weight.data.copy_(lin.weight.data)
    for _ in range(2):
        xi, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        lin(xi).backward(dy)
        ref(xr).backward(dy)
        assert torch.equal(xi.grad, xr.grad)
    assert lin.weight.grad is None and lin.weight.main_grad.dtype == torch.float32
    product = dy.reshape(-1, OUT).float().t() @ x.reshape(-1, IN).float()
    torch.testing.assert_close(lin.weight.main_grad, 2 * product, rtol=1e-6, atol=1e-6)
    if dtype == torch.bfloat16:  # the unfused grad was rounded to bf16 per micro-batch
        assert not torch.equal(lin.weight.main_grad, ref.weight.grad.float())


def test_fused_wgrad_without_recipe_needs_main_grad() -> None:
    lin = Linear(IN, OUT, gradient_accumulation_fusion=True)
    x, _ = inputs()
    with pytest.raises(RuntimeError, match="attach_main_grads"):
        lin(x.requires_grad_())
