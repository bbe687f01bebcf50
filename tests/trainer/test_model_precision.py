"""GPTMoE under every low-precision recipe: which layers run the recipe, init and keys unchanged, short
training runs on CPU (emulated) with finite falling loss, bf16 params, layouts bitwise at model level; on a
Hopper GPU the native fp8 tensorwise model agrees with its emulation."""

from __future__ import annotations

import pytest
import torch

from moectl.core.config.schema import ModelConfig, MoEConfig
from trainer.linear import Linear
from trainer.model import DenseMLP, GPTMoE
from trainer.moe import MoELayer
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
    "delayed": lambda: DelayedRecipe(),
    "rowwise": lambda: RowwiseRecipe(),
    "blockwise": lambda: BlockwiseRecipe(),
    "mxfp8": lambda: MXFP8Recipe(),
    "nvfp4": lambda: NVFP4Recipe(None),
}


def small(**kw) -> tuple[ModelConfig, MoEConfig]:  # type: ignore[no-untyped-def]
    m = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
             vocab_size=64, seq_length=32, moe_layer_freq=[1, 0])  # fmt: skip
    m.update(kw)
    return ModelConfig(**m), MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32)


def model(recipe: Recipe | None, dtype: torch.dtype = torch.float32, grouped: bool = True, **kw: int) -> GPTMoE:
    mcfg, ecfg = small(**kw)
    ecfg.single_grouped_weight = grouped
    return GPTMoE(
        mcfg, ecfg, seed=0, params_dtype=dtype, recipe=recipe, expert_align=recipe.align_size if recipe else 1
    )


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(seed))
    return data[:, :-1], data[:, 1:]


def train(m: GPTMoE, steps: int, lr: float = 3e-3) -> list[float]:
    """Losses of `steps` AdamW steps on one fixed batch (memorising it must drive the loss down)."""
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    tokens, targets = batch()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        parts = m.loss(tokens, targets)
        parts.total.backward()
        opt.step()
        losses.append(parts.lm_loss.item())
    return losses


def test_recipe_reaches_every_block_linear_and_nothing_else() -> None:
    recipe = MXFP8Recipe()
    m = model(recipe)
    moe, dense = m.decoder.layers[0].mlp, m.decoder.layers[1].mlp
    assert isinstance(moe, MoELayer) and isinstance(dense, DenseMLP)
    block_linears = [mod for mod in m.modules() if isinstance(mod, Linear) and mod is not m.output_layer]
    assert len(block_linears) == 2 * 2 + 2  # qkv + proj per layer, fc1 + fc2 of the dense MLP
    assert all(lin.recipe is recipe for lin in block_linears)
    assert moe.experts.recipe is recipe and moe.dispatcher.align == recipe.align_size
    # the head (a Linear only for fused fp32 wgrad accumulation), the embedding and the router stay high precision
    assert m.output_layer.recipe is None
    with pytest.raises(ValueError, match="align_size 32"):
        GPTMoE(*small(), recipe=recipe, expert_align=16)


def test_recipe_changes_neither_keys_nor_init() -> None:
    torch.manual_seed(0)
    plain = model(None).state_dict()
    after_plain = torch.rand(2)
    torch.manual_seed(0)
    quant = model(NVFP4Recipe(None)).state_dict()
    assert torch.equal(torch.rand(2), after_plain)  # the same global RNG draws during construction
    assert list(plain) == list(quant)
    for k in plain:
        assert torch.equal(plain[k], quant[k]), k


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_trains_with_finite_falling_loss(name: str) -> None:
    m = model(RECIPES[name]())
    losses = train(m, steps=6)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5, losses
    # the recipe changed the numbers: not the high-precision run
    assert train(model(None), steps=6) != losses


@pytest.mark.parametrize("name", ["tensorwise", "mxfp8"])
def test_bf16_params_with_a_recipe(name: str) -> None:
    m = model(RECIPES[name](), dtype=torch.bfloat16)
    tokens, targets = batch()
    assert m(tokens).dtype == torch.bfloat16
    m.loss(tokens, targets).total.backward()
    for n, p in m.named_parameters():
        assert p.dtype == (torch.float32 if n.endswith("router.weight") else torch.bfloat16), n  # router scores in fp32
        assert p.grad is not None and p.grad.dtype == p.dtype, n
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n
    losses = train(model(RECIPES[name](), dtype=torch.bfloat16), steps=6)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("name", ["tensorwise", "mxfp8", "nvfp4"])
def test_model_layouts_bitwise_under_a_recipe(name: str) -> None:
    """Single grouped vs per-expert expert weights: the same losses every step and the same params after."""
    a, b = model(RECIPES[name](), grouped=True), model(RECIPES[name](), grouped=False)
    assert train(a, steps=3) == train(b, steps=3)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for lin in ("linear_fc1", "linear_fc2"):
        key = f"decoder.layers.0.mlp.experts.{lin}.weight"
        assert torch.equal(pa[key], torch.stack([pb[f"{key}{e}"] for e in range(4)])), key
    for k in pa:
        if k in pb:
            assert torch.equal(pa[k], pb[k]), k


def test_eval_between_steps_changes_nothing_under_delayed_scaling() -> None:
    a, b = model(DelayedRecipe()), model(DelayedRecipe())
    first = train(a, steps=2)
    assert train(b, steps=2) == first
    with torch.no_grad():
        b.eval()
        b.loss(*batch(seed=1))
        b.train()
    assert train(a, steps=2) == train(b, steps=2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["grouped", "fused"])
def test_native_fp8_tensorwise_model_agrees_with_its_emulation(backend: str) -> None:
    """On sm90: the forward with every GEMM of the block native (`emulate: never`) vs the exact emulation of
    the same recipe, bf16 params. Each GEMM differs only by accumulation order (fast accumulation in fprop)
    and bf16 output rounding, but those differences are re-quantized by the next layer's fp8 cast, so over
    the model they grow to about 1.2-1.3% of the logits (H200: 0.0120 grouped, 0.0131 fused). The bound is
    half of what fp8 itself costs against high precision (about 4-6% here). Grads: see the experts' and the
    precision library's GPU tests (fixed routing, so no top-k flip can amplify a rounding difference)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the native set asserted here is Hopper's")
    dev = torch.device("cuda")
    kw = dict(hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=4)
    tokens, _ = batch()
    logits = {}
    for emulate in ("never", "always"):
        recipe = TensorwiseRecipe("e4m3", emulate=emulate)  # type: ignore[arg-type]
        recipe.check_device(dev)
        m = model(recipe, dtype=torch.bfloat16, **kw).to(dev)
        m.decoder.layers[0].mlp.experts.backend_name = backend
        with torch.no_grad():
            logits[emulate] = m(tokens.to(dev)).float()
    native, emulated = logits["never"], logits["always"]
    err = ((native - emulated).norm() / emulated.norm()).item()
    assert torch.isfinite(native).all() and err < 3e-2, err


@pytest.mark.gpu
def test_native_fp8_model_trains_on_gpu() -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("native fp8 grouped GEMMs are asserted for Hopper")
    recipe = TensorwiseRecipe("e4m3", emulate="never")  # type: ignore[arg-type]
    m = model(recipe, dtype=torch.bfloat16, hidden_size=128, ffn_hidden_size=256, num_query_groups=4).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    tokens, targets = (t.cuda() for t in batch())
    losses = []
    for _ in range(8):
        opt.zero_grad()
        parts = m.loss(tokens, targets)
        parts.total.backward()
        opt.step()
        losses.append(parts.lm_loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5, losses
