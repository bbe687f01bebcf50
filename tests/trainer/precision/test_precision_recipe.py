"""Recipe selection from the config, alignment, device capability and the emulation report."""

from __future__ import annotations

import pytest
import torch

from moectl.core.config.schema import MixedPrecisionConfig
from moectl.core.errors import ConfigError, MoectlError
from trainer.precision import (
    BlockwiseRecipe,
    DelayedRecipe,
    MXFP8Recipe,
    NVFP4Recipe,
    RowwiseRecipe,
    TensorwiseRecipe,
    describe,
    get_recipe,
)


def test_off_gives_none() -> None:
    assert get_recipe(MixedPrecisionConfig()) is None
    assert get_recipe(MixedPrecisionConfig(bf16=True)) is None


@pytest.mark.parametrize(
    "name, cls, align",
    [
        ("tensorwise", TensorwiseRecipe, 16),
        ("delayed", DelayedRecipe, 16),
        ("rowwise", RowwiseRecipe, 16),
        ("blockwise", BlockwiseRecipe, 128),
        ("mxfp8", MXFP8Recipe, 32),
    ],
)
def test_fp8_recipes(name: str, cls: type, align: int) -> None:
    r = get_recipe(MixedPrecisionConfig(fp8="hybrid", fp8_recipe=name, emulate="always"))
    assert type(r) is cls and r.align_size == align and r.emulate == "always"
    assert r.grad_scheme().fmt == "e5m2" and r.weight_scheme().fmt == "e4m3"
    assert get_recipe(MixedPrecisionConfig(fp8="e4m3", fp8_recipe=name)).grad_scheme().fmt == "e4m3"


def test_fp4_recipe_and_exclusivity() -> None:
    r = get_recipe(MixedPrecisionConfig(fp4="e2m1"))
    assert isinstance(r, NVFP4Recipe) and r.align_size == 32
    assert r.weight_scheme().block == (16, 16) and r.activation_scheme().block == (1, 16)
    with pytest.raises(ConfigError, match="exclusive"):
        get_recipe(MixedPrecisionConfig(fp8="e4m3", fp4="e2m1"))


def test_cpu_is_all_emulated_and_says_so() -> None:
    for r in (TensorwiseRecipe(), RowwiseRecipe(), MXFP8Recipe(), NVFP4Recipe(None)):
        assert r.native("cpu") is False
        assert not any(r.native_gemms("cpu").values())
        text = describe(r, "cpu")
        assert "native" not in text.replace("native kernel", "") and text.count("emulated") >= 6
    assert "no fp8/fp4 recipe" in describe(None, "cpu")


def test_emulate_never_refuses_a_device_without_kernels() -> None:
    r = TensorwiseRecipe(emulate="never")
    with pytest.raises(MoectlError, match="emulate"):
        r.check_device("cpu")
    TensorwiseRecipe(emulate="auto").check_device("cpu")  # auto: fine, emulated
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    with pytest.raises(RuntimeError, match="never"):
        r.linear(x, w)


def test_native_rules_per_format(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend to be an H100 (sm90): which GEMMs does each recipe claim as native?
    from trainer.precision import native

    monkeypatch.setattr(native, "capability", lambda device: (9, 0))
    full = {f"{f}.{g}": True for f in ("linear", "grouped") for g in ("fprop", "dgrad", "wgrad")}
    assert TensorwiseRecipe().native_gemms("cuda") == full
    assert RowwiseRecipe().native_gemms("cuda") == full
    # e5m2 grads: _scaled_mm takes e5m2 x e4m3; _scaled_grouped_mm is e4m3 only, so the grouped backward runs
    # in moectl's Triton kernels (per-tensor scales only: hybrid rowwise stays emulated there)
    assert TensorwiseRecipe("hybrid").native_gemms("cuda") == full
    rowwise_hybrid = RowwiseRecipe("hybrid").native_gemms("cuda")
    assert not rowwise_hybrid["linear.dgrad"] and not rowwise_hybrid["grouped.dgrad"]
    for r in (BlockwiseRecipe(), MXFP8Recipe(), NVFP4Recipe(None)):
        assert not any(r.native_gemms("cuda").values())
    assert not any(TensorwiseRecipe(emulate="always").native_gemms("cuda").values())
    text = TensorwiseRecipe("hybrid").describe("cuda")
    assert "grouped GEMMs: fprop native, dgrad native, wgrad native via torch._scaled_grouped_mm / moectl's Triton" in text
    assert "e5m2-grad (hybrid) data and weight grads" in text


@pytest.mark.parametrize("name", ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"])
def test_fast_accum_backward_flag_is_carried_from_the_config(name: str) -> None:
    off = get_recipe(MixedPrecisionConfig(fp8="e4m3", fp8_recipe=name))
    on = get_recipe(MixedPrecisionConfig(fp8="e4m3", fp8_recipe=name, fp8_fast_accum_backward=True))
    assert off.fast_accum_backward is False and on.fast_accum_backward is True
    assert "fast_accum_backward=True" in repr(on) and "fast_accum" not in repr(off)
    assert TensorwiseRecipe().fast_accum_backward is False  # the default keeps split accumulation (TE)


def test_fast_accum_backward_reaches_the_native_gemms(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the native kernels stubbed on CPU (they compute the emulated result and record their accumulation
    flag): fprop is always fast, dgrad and wgrad follow the recipe, for linear and grouped GEMMs."""
    from trainer.precision import gemm, native

    seen: list[tuple[str, bool]] = []

    def fake_mm(a, a_copy, b, b_copy, out_dtype, fast_accum):  # type: ignore[no-untyped-def]
        seen.append(("mm", fast_accum))
        return gemm._mm_emulated(a, a_copy, b, b_copy).to(out_dtype)

    def fake_2d3d(a, a_copy, b, b_copy, out_dtype, fast_accum):  # type: ignore[no-untyped-def]
        seen.append(("2d3d", fast_accum))
        return gemm._grouped_2d3d_emulated(a, b, b_copy).to(out_dtype)

    def fake_2d2d(g, x, fast_accum=False):  # type: ignore[no-untyped-def]
        seen.append(("2d2d", fast_accum))
        return gemm.grouped_wgrad(g, x, mode="emulate")

    monkeypatch.setattr(native, "mm_supported", lambda *a: True)
    monkeypatch.setattr(native, "grouped_supported", lambda *a: True)
    monkeypatch.setattr(native, "mm", fake_mm)
    monkeypatch.setattr(native, "grouped_mm_2d3d", fake_2d3d)
    monkeypatch.setattr(native, "grouped_mm_2d2d", fake_2d2d)
    torch.manual_seed(0)
    x, w, wg = torch.randn(32, 64, requires_grad=True), torch.randn(48, 64, requires_grad=True), torch.randn(2, 48, 64)
    offs = torch.tensor([16, 32])
    for flag in (False, True):
        seen.clear()
        recipe = TensorwiseRecipe(fast_accum_backward=flag)
        recipe.linear(x, w).sum().backward()
        recipe.grouped_linear(x, wg.requires_grad_(), offs).sum().backward()
        assert seen == [("mm", True), ("mm", flag), ("mm", flag), ("2d3d", True), ("2d3d", flag), ("2d2d", flag)]


def test_describe_names_the_backward_accumulation(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.precision import native

    assert "accumulation" not in TensorwiseRecipe(fast_accum_backward=True).describe("cpu")  # nothing native
    monkeypatch.setattr(native, "capability", lambda device: (9, 0))
    assert "dgrad and wgrad split (precise)" in TensorwiseRecipe().describe("cuda")
    assert "dgrad and wgrad fast" in TensorwiseRecipe(fast_accum_backward=True).describe("cuda")
