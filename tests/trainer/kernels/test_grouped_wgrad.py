"""Expert weight grads accumulated into fp32 main_grad (trainer/kernels/grouped_wgrad.py): the definition
on CPU, the Triton kernel on CUDA, and the fused backend / GroupedMLP seam that uses them."""

from __future__ import annotations

import pytest
import torch

from moectl.core.config.schema import MoEConfig
from trainer.kernels import grouped_wgrad
from trainer.kernels.grouped_wgrad import (
    accumulate_grouped_wgrad_,
    grouped_wgrad_reference_,
    in_one_allocation,
    row_aligned,
)
from trainer.main_grad import attach_main_grads
from trainer.moe import GroupedMLP

COUNTS = [5, 0, 70, 1, 130]  # an empty expert, a single row, segments across 64-row tiles


def _problem(device: str, dtype: torch.dtype, M: int = 48, N: int = 80, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = sum(COUNTS)
    a = torch.randn(T, M, generator=g).to(device, dtype)
    b = torch.randn(T, N, generator=g).to(device, dtype)
    counts = torch.tensor(COUNTS, device=device)
    return a, b, counts


def _fp64_products(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
    out, start = [], 0
    for n in COUNTS:
        out.append(a[start:start + n].double().t() @ b[start:start + n].double())
        start += n
    return out


def test_reference_adds_fp32_products_and_leaves_empty_experts() -> None:
    a, b, counts = _problem("cpu", torch.bfloat16)
    targets = [torch.full((48, 80), 0.5) for _ in COUNTS]
    grouped_wgrad_reference_(targets, a, b, counts)
    for t, want in zip(targets, _fp64_products(a, b)):
        torch.testing.assert_close(t.double(), want + 0.5, rtol=1e-5, atol=1e-5)
    assert torch.equal(targets[1], torch.full((48, 80), 0.5))


def test_reference_overwrites_stale_targets_and_clears_their_flags() -> None:
    a, b, counts = _problem("cpu", torch.bfloat16)
    # leftovers of a skipped step may be non-finite: an overwrite must not multiply them by zero
    targets = [torch.full((48, 80), float("nan")) if i % 2 else torch.full((48, 80), 0.5) for i in range(len(COUNTS))]
    flags = torch.tensor([1, 1, 0, 1, 1], dtype=torch.int32)  # expert 2 is fresh: it adds
    grouped_wgrad_reference_(targets, a, b, counts, [flags[i:i + 1] for i in range(len(COUNTS))])
    for i, (t, want) in enumerate(zip(targets, _fp64_products(a, b))):
        torch.testing.assert_close(t.double(), want + (0.5 if i == 2 else 0.0), rtol=1e-5, atol=1e-5)
    assert torch.equal(targets[1], torch.zeros(48, 80))  # an empty stale expert reads as zero
    assert flags.tolist() == [0] * len(COUNTS)


def test_shared_flag_of_a_grouped_weight_settles_every_expert_before_it_is_cleared() -> None:
    a, b, counts = _problem("cpu", torch.bfloat16)
    grad = torch.full((len(COUNTS), 48, 80), 7.0)
    flag = torch.ones(1, dtype=torch.int32)
    accumulate_grouped_wgrad_(list(grad.unbind(0)), a, b, counts, stale_E=[flag] * len(COUNTS))
    for t, want in zip(grad, _fp64_products(a, b)):
        torch.testing.assert_close(t.double(), want, rtol=1e-5, atol=1e-5)
    assert int(flag) == 0
    accumulate_grouped_wgrad_(list(grad.unbind(0)), a, b, counts, stale_E=[flag] * len(COUNTS))  # now it adds
    for t, want in zip(grad, _fp64_products(a, b)):
        torch.testing.assert_close(t.double(), 2 * want, rtol=1e-5, atol=1e-5)


def _mlp(grouped: bool, backend: str, fuse: bool, device: str, dtype: torch.dtype) -> GroupedMLP:
    cfg = MoEConfig(num_experts=len(COUNTS), ffn_hidden_size=32, single_grouped_weight=grouped, backend=backend)
    mlp = GroupedMLP(cfg, 64, init_std=0.3, generator=torch.Generator().manual_seed(3), params_dtype=dtype,
                     gradient_accumulation_fusion=fuse).to(device)
    attach_main_grads(mlp)
    return mlp


def _grads(mlp: GroupedMLP, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    T = sum(COUNTS)
    for micro in range(2):
        x = torch.randn(T, 64, generator=g).to(device, dtype).requires_grad_()
        probs = torch.rand(T, generator=g).to(device)
        mlp(x, torch.tensor(COUNTS, device=device), probs).backward(torch.randn(T, 64, generator=g).to(device, dtype))
    grads = []
    for fc in (mlp.linear_fc1, mlp.linear_fc2):
        ws = fc.weight_params()
        assert all(w.grad is None for w in ws)
        grads.append(torch.stack([w.main_grad for w in ws]) if len(ws) > 1 else ws[0].main_grad.clone())
    return grads


def _check_fused_seam(device: str, dtype: torch.dtype, rtol: float) -> None:
    fused = {grouped: _grads(_mlp(grouped, "fused", True, device, dtype), device, dtype) for grouped in (True, False)}
    for a, b in zip(fused[True], fused[False]):
        assert torch.equal(a, b)  # both layouts: the same kernel on the same values
    unfused = _grads(_mlp(True, "fused", False, device, dtype), device, dtype)
    for a, b in zip(fused[True], unfused):
        # fp32 products against grads rounded to the params' dtype per micro-batch and then added: an element
        # where two micro-batches' large grads cancel keeps their rounding error, so the bound is relative to
        # the tensor's largest grad (bf16: 2^-9 per rounding; measured 0.5% on an H100), not element-wise
        assert float((a - b).abs().max()) <= rtol * float(b.abs().max())


@pytest.mark.parametrize(
    ("ptrs", "want"),
    [
        ([0, 512, 1024], (0, [0, 4, 8])),  # a grouped [3, 4, 32] fp32 main_grad: rows 4 apart (32 floats = 128 B)
        ([2048, 1024, 0], (2, [16, 8, 0])),  # per-expert grads in reverse order, gaps of whole rows
        ([16, 528], (0, [0, 4])),  # starts on a 16-byte boundary
        ([8, 520], None),  # not 16-byte aligned: no TMA descriptor
        ([0, 516], None),  # the second starts mid-row
        ([0, 256], None),  # the two overlap (2 rows apart, 4 rows each)
    ],
)
def test_tma_takes_targets_that_are_whole_rows_of_one_matrix(ptrs: list[int], want: object) -> None:
    assert row_aligned(ptrs, 4, 32) == want


def test_one_view_only_over_targets_of_one_allocation() -> None:
    buf = torch.zeros(4, 8, 16)
    assert in_one_allocation(list(buf.unbind(0)))  # a grouped main_grad
    assert in_one_allocation([buf[3], buf[0]])  # any order
    assert not in_one_allocation([torch.zeros(8, 16) for _ in range(3)])  # separate tensors, however placed


def test_fused_backend_accumulates_expert_grads_in_both_layouts_on_cpu() -> None:
    _check_fused_seam("cpu", torch.float32, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernel_equals_the_definition_on_gpu() -> None:
    a, b, counts = _problem("cuda", torch.bfloat16, M=2048, N=1024)
    ref = [torch.full((2048, 1024), 0.25, device="cuda") for _ in COUNTS]
    got = torch.full((len(COUNTS), 2048, 1024), 0.25, device="cuda")
    grouped_wgrad_reference_(ref, a, b, counts)
    accumulate_grouped_wgrad_(list(got.unbind(0)), a, b, counts)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[1], torch.full_like(got[1], 0.25))  # the empty expert is untouched
    # scattered targets (per-expert main_grads at uneven places in one buffer) get the same values
    buf = torch.full((len(COUNTS) * 2048 * 1024 + 4096,), 0.25, device="cuda")
    starts = [0, 2048 * 1024 + 64, 2 * 2048 * 1024 + 1000, 4 * 2048 * 1024 + 2000, 3 * 2048 * 1024 + 1500]
    scattered = [buf[s:s + 2048 * 1024].view(2048, 1024) for s in starts]
    accumulate_grouped_wgrad_(scattered, a, b, counts)
    for s, g in zip(scattered, got):
        assert torch.equal(s, g)  # the pointer kernel (not row-aligned) == the TMA kernel (a grouped tensor)
    # per-expert grads in reverse order with a gap of whole rows: the TMA kernel with rows that are not e * M
    rev = torch.full((len(COUNTS) + 1, 2048, 1024), 0.25, device="cuda")
    reversed_targets = [rev[len(COUNTS) - i] for i in range(len(COUNTS))]
    accumulate_grouped_wgrad_(reversed_targets, a, b, counts)
    for r, g in zip(reversed_targets, got):
        assert torch.equal(r, g)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [2048, 48], ids=["tma", "pointer"])
def test_triton_kernels_overwrite_stale_targets_bitwise_as_zero_fill_then_add(M: int) -> None:
    a, b, counts = _problem("cuda", torch.bfloat16, M=M, N=1024)
    E = len(COUNTS)
    want = torch.full((E, M, 1024), 0.25, device="cuda")
    want[[0, 1, 3]] = 0.0  # the zero fill zero_grad skipped for the stale experts
    accumulate_grouped_wgrad_(list(want.unbind(0)), a, b, counts)
    got = torch.full((E, M, 1024), float("nan"), device="cuda")
    got[[2, 4]] = 0.25
    flags = torch.tensor([1, 1, 0, 1, 0], dtype=torch.int32, device="cuda")  # per-expert params' own flags
    accumulate_grouped_wgrad_(list(got.unbind(0)), a, b, counts, stale_E=[flags[i:i + 1] for i in range(E)])
    assert torch.equal(got, want)  # the empty stale expert 1 holds zeros, not its NaN leftovers
    assert flags.tolist() == [0] * E
    # the grouped layout: one flag for all E targets
    got.fill_(float("nan"))
    flag = torch.ones(1, dtype=torch.int32, device="cuda")
    accumulate_grouped_wgrad_(list(got.unbind(0)), a, b, counts, stale_E=[flag] * E)
    want.zero_()
    accumulate_grouped_wgrad_(list(want.unbind(0)), a, b, counts)
    assert torch.equal(got, want) and int(flag) == 0


def test_reference_leaves_the_sums_of_squares_of_the_targets_after_the_add() -> None:
    a, b, counts = _problem("cpu", torch.bfloat16)
    targets = [torch.full((48, 80), 0.5) for _ in COUNTS]
    partials = accumulate_grouped_wgrad_(targets, a, b, counts, sq=True)
    assert partials is not None
    want = sum(float(t.double().square().sum()) for t in targets)
    assert float(partials.sum()) == pytest.approx(want, rel=1e-12)
    assert accumulate_grouped_wgrad_(targets, a, b, counts) is None  # only when asked


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M,N", [(2048, 1024), (256, 200), (48, 80)], ids=["tma", "tma-ragged-n", "pointer"])
def test_triton_kernels_leave_the_sums_of_squares_of_their_final_tiles(M: int, N: int) -> None:
    a, b, counts = _problem("cuda", torch.bfloat16, M=M, N=N)
    E = len(COUNTS)
    got = torch.randn(E, M, N, device="cuda")
    got[[0, 1]] = float("nan")  # stale leftovers: overwritten, and never counted
    flags = torch.tensor([1, 1, 0, 0, 0], dtype=torch.int32, device="cuda")
    plain = got.clone()
    plain[[0, 1]] = 0.0
    accumulate_grouped_wgrad_(list(plain.unbind(0)), a, b, counts)
    partials = accumulate_grouped_wgrad_(list(got.unbind(0)), a, b, counts,
                                         stale_E=[flags[i:i + 1] for i in range(E)], sq=True)
    assert partials is not None and partials.dtype == torch.float32
    assert torch.equal(got, plain)  # asking for the sums changes no grad bit
    # expert 3 has one row and expert 1 none (stale: zeros); each untouched or written tile counts once
    want = got.double().square().sum()
    torch.testing.assert_close(partials.double().sum(), want, rtol=1e-6, atol=0)
    again = accumulate_grouped_wgrad_(list(got.clone().unbind(0)), a, b, counts * 0, sq=True)  # no rows at all
    assert again is not None
    torch.testing.assert_close(again.double().sum(), want, rtol=1e-6, atol=0)


def test_earlier_micro_batches_are_added_first_on_the_cpu() -> None:
    sources = [_problem("cpu", torch.bfloat16, seed=s) for s in range(3)]
    want = [torch.full((48, 80), float("nan")) for _ in COUNTS]
    flag = torch.ones(1, dtype=torch.int32)
    got = [t.clone() for t in want]
    for i, (a, b, counts) in enumerate(sources):
        grouped_wgrad_reference_(want, a, b, counts, [flag.clone()] * len(COUNTS) if i == 0 else None)
    *earlier, (a, b, counts, _) = [(a, b, c, None) for a, b, c in sources]
    accumulate_grouped_wgrad_(got, a, b, counts, stale_E=[flag] * len(COUNTS), earlier=earlier)
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and int(flag) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M,N,n", [(256, 200, 2), (256, 200, 4), (2048, 1024, 6), (48, 80, 3)],
                         ids=["tma-2", "tma-4", "tma-6-two-launches", "pointer-3"])
def test_earlier_micro_batches_sum_in_one_pass_as_their_separate_adds(M: int, N: int, n: int) -> None:
    E = len(COUNTS)
    g = torch.Generator().manual_seed(n)
    sources = []
    for s in range(n):  # each micro-batch its own rows per expert: expert 2 only in the last, 1 in none
        counts = [int(c) for c in torch.randint(0, 150, (E,), generator=g)]
        counts[1], counts[2] = 0, (37 if s == n - 1 else 0)
        a = torch.randn(sum(counts), M, generator=g).to("cuda", torch.bfloat16)
        b = torch.randn(sum(counts), N, generator=g).to("cuda", torch.bfloat16)
        sources.append((a, b, torch.tensor(counts, device="cuda")))
    init = torch.randn(E, M, N, device="cuda")
    want = init.clone()
    want[0] = 0.0  # stale: overwritten by the sum of every micro-batch
    for a, b, counts in sources:
        accumulate_grouped_wgrad_(list(want.unbind(0)), a, b, counts)
    got = init.clone()
    got[0] = float("nan")
    got[1] = float("nan")  # stale and without rows anywhere: zeros
    want[1] = 0.0
    flags = torch.tensor([1, 1, 0, 0, 0], dtype=torch.int32, device="cuda")
    *earlier, (a, b, counts, _) = [(a, b, c, None) for a, b, c in sources]
    partials = accumulate_grouped_wgrad_(list(got.unbind(0)), a, b, counts,
                                         stale_E=[flags[i:i + 1] for i in range(E)], sq=True, earlier=earlier)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # one fp32 sum per tile, not n rounded adds
    assert flags.tolist() == [0] * E and torch.equal(got[1], torch.zeros_like(got[1]))
    assert partials is not None
    torch.testing.assert_close(partials.double().sum(), got.double().square().sum(), rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hopper_takes_the_tma_kernel_for_row_aligned_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.kernels import grouped_wgrad_triton as kernels

    if not kernels.tma_supported(torch.device("cuda")):
        pytest.skip("TMA needs compute capability 9.0 (Hopper) or later")
    calls: list[str] = []
    for name in ("grouped_wgrad_accumulate_", "grouped_wgrad_accumulate_tma_"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k)))
    a, b, counts = _problem("cuda", torch.bfloat16, M=256, N=64)
    accumulate_grouped_wgrad_(list(torch.zeros(len(COUNTS), 256, 64, device="cuda").unbind(0)), a, b, counts)
    a, b, counts = _problem("cuda", torch.bfloat16, M=48, N=64)  # 48 rows: not whole 128-row tiles
    accumulate_grouped_wgrad_(list(torch.zeros(len(COUNTS), 48, 64, device="cuda").unbind(0)), a, b, counts)
    assert calls == ["grouped_wgrad_accumulate_tma_", "grouped_wgrad_accumulate_"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_backend_accumulates_expert_grads_in_both_layouts_on_gpu() -> None:
    _check_fused_seam("cuda", torch.bfloat16, rtol=2e-2)  # 4x the measured 0.5%
