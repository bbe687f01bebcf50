"""The fp8 grouped weight grad accumulated into fp32 main_grad (trainer/kernels/fp8_wgrad_triton.py, GPU),
against the fp64 definition and against torch's `_scaled_grouped_mm` (what the unfused path adds)."""

from __future__ import annotations

import pytest
import torch

from trainer.kernels import has_triton

gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and has_triton() and torch.cuda.get_device_capability()[0] >= 9),
    reason="needs a Hopper or later GPU with Triton (run on the device tool)",
)
pytestmark = [gpu, needs_hopper]

# an empty group, groups that end inside a 128-column block, one of exactly one block, one spanning three
COUNTS = [16, 0, 144, 128, 400, 48]
M, N = 384, 192  # 128-row tiles (384 is no whole 256-row tile); N ends inside a tile


def _operands(seed: int = 0, counts: list[int] = COUNTS):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(counts)
    a = (torch.randn(M, T, device="cuda", generator=g) * 30).to(torch.float8_e4m3fn)
    b = (torch.randn(N, T, device="cuda", generator=g) * 30).to(torch.float8_e4m3fn)
    sa = torch.rand(len(counts), device="cuda", generator=g) * 1e-3 + 1e-4
    sb = torch.rand(len(counts), device="cuda", generator=g) * 1e-3 + 1e-4
    offs = torch.cumsum(torch.tensor(counts, device="cuda"), 0)
    return a, b, sa, sb, offs


def _fp64(a, b, sa, sb, counts: list[int] = COUNTS) -> list[torch.Tensor]:
    out, start = [], 0
    for e, n in enumerate(counts):
        out.append((a[:, start:start + n].double() @ b[:, start:start + n].double().t()) * float(sa[e] * sb[e]))
        start += n
    return out


@pytest.mark.parametrize("counts", [COUNTS], ids=["aligned"])
@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("layout", ["grouped", "per-expert-with-gaps"])
def test_kernel_adds_the_scaled_fp32_product_into_each_experts_rows(fast_accum: bool, layout: str,
                                                                   counts: list[int]) -> None:  # fmt: skip
    from trainer.kernels.fp8_wgrad_triton import fits, fp8_grouped_wgrad_accumulate_tma_
    from trainer.kernels.grouped_wgrad import rows_view

    a, b, sa, sb, offs = _operands(counts=counts)
    E = len(counts)
    gap = 0 if layout == "grouped" else 3  # per-expert main_grads sit in one buffer with rows between them
    buf = torch.randn(E * (M + gap), N, device="cuda")
    targets = [buf[e * (M + gap): e * (M + gap) + M] for e in reversed(range(E))][::-1]  # any order of rows
    start = [t.clone() for t in targets]
    assert fits(a, b, M)
    view = rows_view(targets)
    assert view is not None
    fp8_grouped_wgrad_accumulate_tma_(*view, a, b, offs, sa, sb, fast_accum=fast_accum)
    # relative to fp64: the tensor cores' fp8 accumulator holds ~14 mantissa bits (measured 7.6e-5 over 128
    # products in precise mode, which promotes into fp32 every 128); fast mode keeps it for a whole group
    tol = 2e-3 if fast_accum else 2e-4
    for e, (t, t0, want) in enumerate(zip(targets, start, _fp64(a, b, sa, sb, counts))):
        if counts[e] == 0:
            assert torch.equal(t, t0)  # an empty expert's grad is untouched
            continue
        err = ((t.double() - t0.double()) - want).norm() / want.norm()
        assert err < tol, (e, float(err))
    if gap:
        between = torch.cat([buf[e * (M + gap) + M: (e + 1) * (M + gap)] for e in range(E)])
        assert torch.isfinite(between).all()  # rows outside the targets are read and written by no tile
    torch.cuda.synchronize()


def test_recipe_path_matches_the_scaled_grouped_mm_it_replaces() -> None:
    # what the fused backend does under fp8 tensorwise with gradient-accumulation fusion, against the unfused
    # path's bf16 `_scaled_grouped_mm` product added into main_grad: equal within that product's bf16 rounding
    from trainer.precision import TensorwiseRecipe
    from trainer.precision.groups import TokenGroups
    from trainer.precision.native import grouped_mm_2d2d, grouped_wgrad_accumulate_

    g = torch.Generator(device="cuda").manual_seed(1)
    T, O, D, E = sum(COUNTS), 256, 384, len(COUNTS)
    offs = torch.cumsum(torch.tensor(COUNTS, device="cuda"), 0)
    groups = TokenGroups.from_offsets(offs, T)
    recipe = TensorwiseRecipe()
    dy = torch.randn(T, O, device="cuda", generator=g).bfloat16()
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    gq = recipe.quantize_grad(dy, groups=groups, rowwise=True, columnwise=True)
    xq = recipe.quantize_activation(x, groups=groups, rowwise=True, columnwise=True)
    main_grad = torch.randn(E, O, D, device="cuda")
    start = main_grad.clone()
    unfused = grouped_mm_2d2d(gq, xq).float()  # bf16 product, as the unfused path adds it
    assert grouped_wgrad_accumulate_(gq, xq, list(main_grad.unbind(0)))
    fused = main_grad - start
    err = (fused - unfused).norm() / unfused.norm()
    assert 0 < err < 1e-2, float(err)  # within the bf16 rounding the fused path no longer does
    assert torch.count_nonzero(fused[1]) == 0  # the empty expert
