"""Emulated linear / grouped_linear forward and backward: bitwise against an explicit
dequantize-then-matmul reference, within each recipe's tolerance of high precision, grouped equal to the
per-expert loop, and the weight-grad routes (autograd, fused main_grad, pre-quantized weights)."""

from __future__ import annotations

import pytest
import torch

from trainer.main_grad import READY_HOOK
from trainer.precision import (
    BlockwiseRecipe,
    DelayedRecipe,
    MXFP8Recipe,
    NVFP4Recipe,
    Recipe,
    RowwiseRecipe,
    TensorwiseRecipe,
    quantize,
)

RECIPES = {
    "tensorwise": lambda: TensorwiseRecipe(),
    "tensorwise-hybrid": lambda: TensorwiseRecipe("hybrid"),
    "delayed": lambda: DelayedRecipe(),
    "rowwise": lambda: RowwiseRecipe(),
    "blockwise": lambda: BlockwiseRecipe(),
    "mxfp8": lambda: MXFP8Recipe(),
    "mxfp8-hybrid": lambda: MXFP8Recipe("hybrid"),
    "nvfp4": lambda: NVFP4Recipe(None),
}
# relative L2 error vs fp32 for y / dx / dW (e4m3 ~ 2^-4 per element, e5m2 ~ 2^-3, e2m1 ~ 2^-2 + scales)
TOLERANCE = {"tensorwise": 0.06, "delayed": 0.06, "rowwise": 0.06, "blockwise": 0.06, "mxfp8": 0.07, "nvfp4": 0.3}
GRAD_TOLERANCE_HYBRID = 0.12


def _inputs(T: int = 48, D: int = 64, O: int = 32, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(O, D, generator=g) * 0.1).to(dtype).requires_grad_()
    dy = torch.randn(T, O, generator=g).to(dtype)
    return x, w, dy


def _reference(recipe: Recipe, x, w, dy, state=None):
    """Dequantize the recipe's quantized operands and multiply in fp32, written out GEMM by GEMM."""
    xq = recipe.quantize_activation(x.detach(), state=state)
    wq = recipe.quantize_weight(w.detach(), state=state)
    gq = recipe.quantize_grad(dy, state=state)
    y = (xq.dequantize_copy("rowwise") @ wq.dequantize_copy("rowwise").T).to(x.dtype)
    dx = (gq.dequantize(torch.float32) @ wq.dequantize(torch.float32, copy="columnwise")).to(x.dtype)
    dw = gq.dequantize(torch.float32, copy="columnwise").T @ xq.dequantize(torch.float32, copy="columnwise")
    return y, dx, dw


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_dequantize_then_matmul_bitwise(name: str, dtype: torch.dtype) -> None:
    recipe = RECIPES[name]()
    x, w, dy = _inputs(dtype=dtype)
    state, ref_state = recipe.new_state(), recipe.new_state()
    y = recipe.linear(x, w, state=state)
    y.backward(dy)
    y_ref, dx_ref, dw_ref = _reference(recipe, x, w, dy, ref_state)
    assert y.dtype == dtype and x.grad.dtype == dtype
    assert torch.equal(y, y_ref)
    assert torch.equal(x.grad, dx_ref)
    assert torch.equal(w.grad, dw_ref.to(dtype))


@pytest.mark.parametrize("name", RECIPES)
def test_linear_close_to_high_precision(name: str) -> None:
    recipe = RECIPES[name]()
    x, w, dy = _inputs(T=128, D=128, O=64)
    y = recipe.linear(x, w, state=recipe.new_state())
    y.backward(dy)
    y_hp = x.detach() @ w.detach().T
    dx_hp, dw_hp = dy @ w.detach(), dy.T @ x.detach()
    base = name.split("-")[0]
    tol_f = TOLERANCE[base]
    tol_b = GRAD_TOLERANCE_HYBRID if name.endswith("hybrid") else tol_f
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(y, y_hp) < tol_f
    assert rel(x.grad, dx_hp) < tol_b
    assert rel(w.grad, dw_hp) < tol_b


def _grouped_inputs(recipe: Recipe, E: int = 3, D: int = 64, O: int = 32, seed: int = 1):
    a = recipe.align_size
    counts = [2 * a, 0, a]  # an expert without tokens too
    T = sum(counts)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).requires_grad_()
    w = (torch.randn(E, O, D, generator=g) * 0.1)
    w[2] *= 20  # experts of different ranges
    w.requires_grad_()
    dy = torch.randn(T, O, generator=g)
    return x, w, dy, counts


@pytest.mark.parametrize("name", RECIPES)
def test_grouped_linear_equals_per_expert_loop_bitwise(name: str) -> None:
    recipe = RECIPES[name]()
    x, w, dy, counts = _grouped_inputs(recipe)
    offs = torch.tensor(counts).cumsum(0)
    y = recipe.grouped_linear(x, w, offs, state=recipe.new_state(len(counts)))
    y.backward(dy)

    xs = x.detach().split(counts)
    dys = dy.split(counts)
    for e in range(len(counts)):
        xe = xs[e].clone().requires_grad_()
        we = w.detach()[e].clone().requires_grad_()
        ye = recipe.linear(xe, we, state=recipe.new_state())
        ye.backward(dys[e])
        rows = slice(sum(counts[:e]), sum(counts[: e + 1]))
        assert torch.equal(y[rows], ye), f"y of expert {e}"
        assert torch.equal(x.grad[rows], xe.grad), f"dx of expert {e}"
        assert torch.equal(w.grad[e], we.grad), f"dW of expert {e}"
    assert torch.count_nonzero(w.grad[1]) == 0  # no tokens, no grad


def test_grouped_linear_close_to_high_precision() -> None:
    recipe = MXFP8Recipe()
    x, w, dy, counts = _grouped_inputs(recipe)
    offs = torch.tensor(counts).cumsum(0)
    y = recipe.grouped_linear(x, w, offs)
    y_hp = torch.cat([xe @ w.detach()[e].T for e, xe in enumerate(x.detach().split(counts))])
    assert ((y - y_hp).norm() / y_hp.norm()).item() < 0.07


def test_grouped_linear_rejects_unaligned_groups_and_bad_offsets() -> None:
    recipe = MXFP8Recipe()
    x, w = torch.randn(64, 64, requires_grad=True), torch.randn(2, 32, 64, requires_grad=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        recipe.grouped_linear(x, w, torch.tensor([16, 64]))
    with pytest.raises(ValueError, match="offs"):
        recipe.grouped_linear(x, w, torch.tensor([16, 60]))
    with pytest.raises(ValueError, match="2 experts"):
        recipe.grouped_linear(x, w, torch.tensor([64]))


def test_leading_dims_and_no_grad() -> None:
    recipe = TensorwiseRecipe()
    x = torch.randn(2, 5, 64)
    w = torch.randn(32, 64, requires_grad=True)
    y = recipe.linear(x, w)
    assert y.shape == (2, 5, 32)
    with torch.no_grad():
        assert torch.equal(recipe.linear(x, w), y.detach())


def test_fused_wgrad_goes_to_main_grad() -> None:
    recipe = RowwiseRecipe()
    x, w, dy = _inputs()
    w_param = torch.nn.Parameter(w.detach().clone())
    w_param.main_grad = torch.full_like(w_param, 1.0)
    calls = []
    setattr(w_param, READY_HOOK, lambda p: calls.append(p))
    y = recipe.linear(x, w_param, fuse_wgrad=True)
    y.backward(dy)
    _, _, dw_ref = _reference(recipe, x, w, dy)
    assert w_param.grad is None
    assert torch.equal(w_param.main_grad, 1.0 + dw_ref)
    assert len(calls) == 1 and calls[0] is w_param


@pytest.mark.parametrize("name", ["tensorwise", "blockwise", "mxfp8", "nvfp4"])
def test_prequantized_weight_path(name: str) -> None:
    """fp8/fp4 params: the layer holds only a QuantizedTensor; the grad goes to the param it belongs to."""
    recipe = RECIPES[name]()
    x, w, dy = _inputs()
    wq = recipe.quantize_weight(w.detach())
    holder = torch.nn.Parameter(torch.zeros_like(w))  # receives the weight grad; its values are never read
    y = recipe.linear(x, wq, param=holder)
    y.backward(dy)
    y_ref, dx_ref, dw_ref = _reference(recipe, x, w, dy)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, dx_ref) and torch.equal(holder.grad, dw_ref)


def test_prequantized_rowwise_only_weight() -> None:
    # per-tensor: the columnwise copy is built on demand (exact); 1x32 blocks cannot be, so it errors.
    x, w, dy = _inputs()
    recipe = TensorwiseRecipe()
    wq = recipe.quantize_weight(w.detach(), columnwise=False)
    recipe.linear(x, wq).backward(dy)
    assert wq.columnwise is not None
    mx = MXFP8Recipe()
    with pytest.raises(ValueError, match="re-quantize"):
        mx.linear(x, mx.quantize_weight(w.detach(), columnwise=False))


def test_grouped_prequantized_weight_per_expert_params_fused() -> None:
    """Per-expert layout with fp8 params: one grouped QuantizedTensor, E params owning main_grads."""
    recipe = TensorwiseRecipe()
    x, w, dy, counts = _grouped_inputs(recipe)
    offs = torch.tensor(counts).cumsum(0)
    params = [torch.nn.Parameter(torch.zeros(w.shape[1:])) for _ in counts]
    for p in params:
        p.main_grad = torch.zeros_like(p)
    wq = recipe.quantize_weight(w.detach())
    y = recipe.grouped_linear(x, wq, offs, param=params, fuse_wgrad=True)
    y.backward(dy)
    y2 = recipe.grouped_linear(x.detach().requires_grad_(), w, offs)
    y2.backward(dy)
    assert torch.equal(y, y2)
    for e, p in enumerate(params):
        assert p.grad is None and torch.equal(p.main_grad, w.grad[e])


def test_grouped_per_expert_params_unfused_get_autograd_grads() -> None:
    recipe = NVFP4Recipe(None)
    x, w, dy, counts = _grouped_inputs(recipe)
    offs = torch.tensor(counts).cumsum(0)
    params = [torch.nn.Parameter(torch.zeros(w.shape[1:])) for _ in counts]
    recipe.grouped_linear(x, recipe.quantize_weight(w.detach()), offs, param=params).backward(dy)
    recipe.grouped_linear(x.detach(), w, offs).backward(dy)
    for e, p in enumerate(params):
        assert torch.equal(p.grad, w.grad[e])


def test_delayed_needs_state() -> None:
    x, w, _ = _inputs()
    with pytest.raises(ValueError, match="new_state"):
        DelayedRecipe().linear(x, w)


def test_quantize_is_one_call_for_a_grouped_weight() -> None:
    # ONE quantize over [E, out, in] (no per-expert loop inside): the scale tensors carry the expert dim.
    w = torch.randn(8, 32, 64)
    for recipe in (TensorwiseRecipe(), MXFP8Recipe(), NVFP4Recipe(None)):
        q = recipe.quantize_weight(w)
        assert q.rowwise.scale.shape[0] == 8 and q.columnwise.data.shape[:2] == (8, 64)
    assert quantize(w, TensorwiseRecipe().weight_scheme()).rowwise.scale.shape == (8,)
