"""The precise fp8 grouped GEMM for the experts' data grad (trainer/kernels/fp8_grouped_mm_triton.py, GPU),
against fp64 and against torch's `_scaled_grouped_mm` with split accumulation, which it replaces."""

from __future__ import annotations

import pytest
import torch

from trainer.kernels import has_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and has_triton() and torch.cuda.get_device_capability()[0] >= 9),
        reason="needs a Hopper or later GPU with Triton (run on the device tool)",
    ),
]

# an empty group, groups ending inside a 128-row tile, one of exactly one tile, one of several
COUNTS = [16, 0, 144, 128, 400, 48, 32]
N, K = 256, 384


def _operands(seed: int = 0, a_dtype: torch.dtype = torch.float8_e4m3fn):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, E = sum(COUNTS), len(COUNTS)
    a = (torch.randn(T, K, device="cuda", generator=g) * 30).to(a_dtype)
    b = (torch.randn(E, N, K, device="cuda", generator=g) * 30).to(torch.float8_e4m3fn)
    sa = torch.rand(E, device="cuda", generator=g) * 1e-3 + 1e-4
    sb = torch.rand(E, device="cuda", generator=g) * 1e-3 + 1e-4
    offs = torch.cumsum(torch.tensor(COUNTS, device="cuda"), 0)
    return a, b, sa, sb, offs


@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("a_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_rows_of_each_group_times_its_expert_against_fp64_and_torch(a_dtype: torch.dtype, fast_accum: bool) -> None:
    # e5m2 rows times e4m3 weights: fp8 hybrid's data grad, which torch's grouped kernel does not take
    from trainer.kernels.fp8_grouped_mm_triton import fits, fp8_grouped_mm

    a, b, sa, sb, offs = _operands(a_dtype=a_dtype)
    assert fits(a, b)
    got = fp8_grouped_mm(a, b, offs, sa, sb, fast_accum=fast_accum)
    want, start = [], 0
    for e, n in enumerate(COUNTS):
        want.append((a[start:start + n].double() @ b[e].double().t()) * float(sa[e] * sb[e]))
        start += n
    want_t = torch.cat(want)
    err = (got.double() - want_t).norm() / want_t.norm()
    assert err < 5e-3, float(err)  # the bf16 output's rounding
    if a_dtype != torch.float8_e4m3fn or fast_accum:
        return
    ids = torch.repeat_interleave(torch.arange(len(COUNTS), device="cuda"), torch.tensor(COUNTS, device="cuda"))
    ref = torch._scaled_grouped_mm(
        a, b.transpose(-2, -1), sa[ids].contiguous(), (sb[:, None].expand(-1, N)).contiguous(),
        offs=offs.to(torch.int32), out_dtype=torch.bfloat16, use_fast_accum=False,
    )  # fmt: skip
    err_torch = (ref.double() - want_t).norm() / want_t.norm()
    assert err < 2 * err_torch + 1e-4, (float(err), float(err_torch))  # as precise as torch's precise kernel


def test_the_recipe_data_grad_takes_it_where_it_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.kernels import fp8_grouped_mm_triton as kernel
    from trainer.precision import TensorwiseRecipe
    from trainer.precision.groups import TokenGroups

    calls: list[int] = []
    real = kernel.fp8_grouped_mm
    monkeypatch.setattr(kernel, "fp8_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator(device="cuda").manual_seed(1)
    T, E, O, D = sum(COUNTS), len(COUNTS), 256, 384
    groups = TokenGroups.from_offsets(torch.cumsum(torch.tensor(COUNTS, device="cuda"), 0), T)
    recipe = TensorwiseRecipe()
    dy = torch.randn(T, O, device="cuda", generator=g).bfloat16()
    w = torch.randn(E, O, D, device="cuda", generator=g).bfloat16()
    gq = recipe.quantize_grad(dy, groups=groups, rowwise=True, columnwise=False)
    wq = recipe.quantize_weight(w, columnwise=True)
    dx = recipe.grouped_dgrad(gq, wq, torch.bfloat16)
    assert calls == [1]
    want = torch.cat([dy[s:e].double() @ w[i].double() for i, (s, e) in
                      enumerate(zip([0, *groups.offsets[:-1].tolist()], groups.offsets.tolist()))])  # fmt: skip
    assert float((dx.double() - want).norm() / want.norm()) < 0.1  # two e4m3 roundings
    fast = TensorwiseRecipe(fast_accum_backward=True).grouped_dgrad(gq, wq, torch.bfloat16)
    assert calls == [1] and fast.shape == dx.shape  # fast accumulation stays with torch's kernel


def test_hybrid_grouped_backward_runs_in_triton_against_emulation() -> None:
    # fp8 hybrid: e5m2 grads; the data grad and the weight grad (into fresh fp32) leave emulation
    from trainer.precision import TensorwiseRecipe, gemm
    from trainer.precision.groups import TokenGroups

    g = torch.Generator(device="cuda").manual_seed(2)
    T, E, O, D = sum(COUNTS), len(COUNTS), 256, 384
    groups = TokenGroups.from_offsets(torch.cumsum(torch.tensor(COUNTS, device="cuda"), 0), T)
    recipe = TensorwiseRecipe("hybrid")
    assert recipe.native_gemms("cuda")["grouped.dgrad"] and recipe.native_gemms("cuda")["grouped.wgrad"]
    dy = torch.randn(T, O, device="cuda", generator=g).bfloat16()
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(E, O, D, device="cuda", generator=g).bfloat16()
    gq = recipe.quantize_grad(dy, groups=groups, rowwise=True, columnwise=True)
    xq = recipe.quantize_activation(x, groups=groups, rowwise=True, columnwise=True)
    wq = recipe.quantize_weight(w, columnwise=True)
    assert gq.copy("rowwise").data.dtype == torch.float8_e5m2
    dx = recipe.grouped_dgrad(gq, wq, torch.bfloat16)
    dx_ref = gemm.grouped_dgrad(gq, wq, out_dtype=torch.float32, mode="emulate")
    assert float((dx.float() - dx_ref).norm() / dx_ref.norm()) < 5e-3
    dw = recipe.grouped_wgrad(gq, xq)
    dw_ref = gemm.grouped_wgrad(gq, xq, mode="emulate")
    assert dw.dtype == torch.float32 and float((dw - dw_ref).norm() / dw_ref.norm()) < 3e-4
    assert torch.count_nonzero(dw[1]) == 0  # the empty expert
