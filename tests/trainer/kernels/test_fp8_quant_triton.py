"""The fused per-tensor FP8 quantizers (trainer/kernels/fp8_quant_triton.py) against the eager path.

GPU tests (marked `gpu`, skipped without CUDA): the Triton path of `quantize` (taken for the `tensor` kind on
CUDA) gives exactly the eager QuantizedTensor (kinds/per_tensor.py + formats.cast_to_fp8): the same bytes of
both copies and the same scales, bit for bit, for bf16 and fp32 inputs, a grouped weight `[E, M, K]` and a
jagged activation with empty and ragged groups, and NaN / inf / saturating / all-zero / tiny inputs. Also the
amax kernel, the delayed recipe's in-pass amax, the empty-expert zeroing, and the fused fp8 expert MLP with
fast-accumulating backward GEMMs against the emulated recipe. The eager reference is the same function with
the fast path switched off (`MOECTL_TRITON_QUANTIZE=0`), so both run on the same device.

CPU tests: the selection (no fast path off CUDA, nor for other kinds), and the torch fallbacks.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from trainer.precision import DelayedRecipe, QuantizedTensor, Scheme, TensorwiseRecipe, quantize
from trainer.precision.groups import Jagged, TokenGroups
from trainer.precision.kinds import per_tensor
from trainer.precision.qdata import QuantizedData
from trainer.precision.quantize import quantize_with_amax, triton_fast_path

gpu = pytest.mark.gpu
OFF = "MOECTL_TRITON_QUANTIZE"


# ----------------------------------------------------------------------------------------------------------
# helpers


def _same_data(a: Optional[QuantizedData], b: Optional[QuantizedData], what: str) -> None:
    assert (a is None) == (b is None), what
    if a is None or b is None:
        return
    assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and a.data.is_contiguous(), what
    diff = a.data.view(torch.uint8) != b.data.view(torch.uint8)
    assert not diff.any(), f"{what}: {int(diff.sum())} bytes differ, e.g. at {diff.nonzero()[:4].tolist()}"
    assert a.scale.dtype == b.scale.dtype == torch.float32 and a.scale.shape == b.scale.shape, what
    assert torch.equal(a.scale.view(torch.int32), b.scale.view(torch.int32)), f"{what}: scales differ"
    assert a.global_scale is None and b.global_scale is None


def assert_same(fast: QuantizedTensor, ref: QuantizedTensor) -> None:
    """Bitwise the same QuantizedTensor: scheme, shape, dtype, groups, recipe, data bytes and scales."""
    assert fast.scheme == ref.scheme and fast.shape == ref.shape and fast.dtype == ref.dtype
    assert fast.recipe == ref.recipe and fast.groups is ref.groups
    _same_data(fast.rowwise, ref.rowwise, "rowwise")
    _same_data(fast.columnwise, ref.columnwise, "columnwise")


def _spy_kernel(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count calls of the Triton quantize launcher (proof that the fast path ran)."""
    from trainer.kernels import fp8_quant_triton as tq

    calls: list[int] = []
    real = tq.quantize

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tq, "quantize", counted)
    return calls


def _both(monkeypatch: pytest.MonkeyPatch, fn):  # type: ignore[no-untyped-def]
    """(fn() on the Triton path, fn() on the eager path), checking the Triton path really ran."""
    calls = _spy_kernel(monkeypatch)
    monkeypatch.delenv(OFF, raising=False)
    fast = fn()
    assert calls, "the Triton fast path did not run"
    monkeypatch.setenv(OFF, "0")
    n = len(calls)
    ref = fn()
    assert len(calls) == n, "the eager reference went through the Triton path"
    monkeypatch.delenv(OFF)
    return fast, ref


def _weight(E: int, M: int, K: int, dtype: torch.dtype, special: bool) -> torch.Tensor:
    """A grouped weight `[E, M, K]`; with `special`, one expert per edge case."""
    g = torch.Generator(device="cuda").manual_seed(E * 1000 + M)
    w = torch.randn(E, M, K, device="cuda", generator=g)
    if special:
        w[0] *= 0.02  # ordinary
        w[1] = 0.0  # all zero: amax 0, scale 1, zero bytes
        w[2, 3, 5] = float("nan")  # NaN poisons the amax (scale 1) and stays NaN
        w[2, 7, 1] = -float("nan")
        w[3, 0, 0] = float("inf")  # inf amax: scale 1, values saturate to +-max
        w[3, 1, 2] = -float("inf")
        w[3, 4] *= 1e4  # beyond fp8 range under scale 1
        w[4] *= 1e-30  # tiny amax: fmax / amax overflows fp32 -> FLT_MAX, and subnormal fp8 results
        w[5, 2, 2] = 3e38
    return w.to(dtype)


def _jagged(counts: list[int], K: int, dtype: torch.dtype, special: bool) -> tuple[torch.Tensor, TokenGroups]:
    T = sum(counts)
    g = torch.Generator(device="cuda").manual_seed(T + K)
    x = torch.randn(T, K, device="cuda", generator=g) * 3
    offs = torch.tensor(counts, device="cuda").cumsum(0)
    groups = TokenGroups.from_offsets(offs, T, validate=False)
    if special:
        starts = [sum(counts[:i]) for i in range(len(counts))]
        nonempty = [(s, n) for s, n in zip(starts, counts) if n]
        s0, _ = nonempty[0]
        x[s0 + 1, 3] = float("nan")
        if len(nonempty) > 2:  # an all-zero group, kept apart from the NaN and inf groups
            s1, n1 = nonempty[1]
            x[s1 : s1 + n1] = 0.0
        s2, n2 = nonempty[-1]
        x[s2, 0] = -float("inf")
        x[s2 + n2 - 1] *= 1e3
    return x.to(dtype), groups


# ----------------------------------------------------------------------------------------------------------
# GPU: bitwise against the eager path


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt, pow2", [("e4m3", False), ("e5m2", False), ("e4m3", True)])
@pytest.mark.parametrize("special", [False, True])
def test_grouped_weight_matches_eager_bitwise(monkeypatch, dtype, fmt, pow2, special):  # type: ignore[no-untyped-def]
    # M and K are not multiples of the 64 x 128 tile, and span several tiles
    w = _weight(6, 200, 328, dtype, special)
    scheme = Scheme("tensor", fmt, pow2=pow2)
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        fast, ref = _both(monkeypatch, lambda: quantize(w, scheme, rowwise=rowwise, columnwise=columnwise, recipe="t"))
        assert_same(fast, ref)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_recipe_weight_quantize_takes_the_fast_path(monkeypatch, dtype):  # type: ignore[no-untyped-def]
    """`Recipe.quantize_weight` of a grouped weight (the optimizer's post-step quantize) and of a 2-D weight."""
    recipe = TensorwiseRecipe()
    for w in (_weight(4, 96, 256, dtype, False), _weight(1, 384, 512, dtype, False)[0]):
        fast, ref = _both(monkeypatch, lambda: recipe.quantize_weight(w))
        assert_same(fast, ref)
        assert fast.rowwise is not None and fast.rowwise.scale.shape == w.shape[:-2]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize(
    "counts",
    [[48, 0, 16, 112, 0, 32], [0, 64, 80, 0], [5, 0, 7, 130, 1]],  # aligned with empty groups; ragged (tiles span groups)
    ids=["aligned", "leading-empty", "ragged"],
)
@pytest.mark.parametrize("special", [False, True])
def test_jagged_activation_matches_eager_bitwise(monkeypatch, dtype, fmt, counts, special):  # type: ignore[no-untyped-def]
    x, groups = _jagged(counts, 200, dtype, special)
    scheme = Scheme("tensor", fmt)
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        fast, ref = _both(
            monkeypatch, lambda: quantize(x, scheme, rowwise=rowwise, columnwise=columnwise, groups=groups, recipe="t")
        )
        assert_same(fast, ref)
        q = fast.columnwise if fast.columnwise is not None else fast.rowwise
        assert q is not None and q.scale.shape == (len(counts),)
        _check_gemm_scales(fast, groups)


def _check_gemm_scales(q: QuantizedTensor, groups: TokenGroups) -> None:
    """The expanded decode scales the scales kernel wrote are the group scales per row / group-major per
    column, bit for bit (what native.py would otherwise expand with index_select / expand)."""
    if q.rowwise is not None:
        assert q.rowwise.gemm_scale is not None
        assert torch.equal(q.rowwise.gemm_scale.view(torch.int32), q.rowwise.scale[groups.ids].view(torch.int32))
    if q.columnwise is not None:
        K = q.shape[-1]
        want = q.columnwise.scale.repeat_interleave(K)
        assert q.columnwise.gemm_scale is not None and torch.equal(q.columnwise.gemm_scale.view(torch.int32), want.view(torch.int32))
        assert "gemm_scale" not in q.columnwise.tensors()  # derived: never stored or counted


@gpu
@pytest.mark.parametrize("K", [1536, 4096, 200])
def test_tma_columnwise_store_matches_pointer_store(monkeypatch, K):  # type: ignore[no-untyped-def]
    """On Hopper the columnwise copy of one matrix goes out through a TMA descriptor (both tiles: K >= 4096
    takes the wide one; K = 200 has a partial edge tile that TMA clips); it must give the pointer store's bytes."""
    from trainer.kernels import fp8_quant_triton as tq

    if torch.cuda.get_device_capability()[0] < 9 or tq.TensorDescriptor is None:
        pytest.skip("TMA stores need Hopper and Triton tensor descriptors")
    counts = [256, 0, 320, 448]  # 1024 rows: a multiple of 16 bytes per columnwise row, so TMA applies
    x, groups = _jagged(counts, K, torch.bfloat16, True)
    scheme = Scheme("tensor", "e4m3")
    taken: list[bool] = []
    real = tq._col_tma_ok
    monkeypatch.setattr(tq, "_col_tma_ok", lambda col: taken.append(real(col)) or taken[-1])
    tma = quantize(x, scheme, rowwise=True, columnwise=True, groups=groups)
    monkeypatch.setenv("MOECTL_QUANT_TMA", "0")
    plain = quantize(x, scheme, rowwise=True, columnwise=True, groups=groups)
    assert taken == [True, False]
    assert_same(tma, plain)


@gpu
def test_recipe_activation_and_grad_quantize_match_eager(monkeypatch):  # type: ignore[no-untyped-def]
    x, groups = _jagged([32, 0, 96, 16], 256, torch.bfloat16, True)
    for recipe in (TensorwiseRecipe("e4m3"), TensorwiseRecipe("hybrid")):
        fast, ref = _both(monkeypatch, lambda: recipe.quantize_activation(x, groups=groups))
        assert_same(fast, ref)
        fast, ref = _both(monkeypatch, lambda: recipe.quantize_grad(x, groups=groups))
        assert_same(fast, ref)


@gpu
def test_amax_and_encode_overrides_match_eager(monkeypatch):  # type: ignore[no-untyped-def]
    """An all-reduced amax (sharded params) and a given encode scale, in the per-tensor shape and in a shape
    the eager path broadcasts (which the fast path hands back to it)."""
    w = _weight(3, 64, 160, torch.bfloat16, False)
    scheme = Scheme("tensor", "e4m3")
    amax = w.float().abs().amax(dim=(-2, -1)) * 2
    for kw in ({"amax": amax}, {"encode_scale": 448.0 / amax}):
        fast, ref = _both(monkeypatch, lambda: quantize(w, scheme, rowwise=True, columnwise=True, **kw))
        assert_same(fast, ref)
    calls = _spy_kernel(monkeypatch)
    for kw in ({"amax": amax.max()}, {"encode_scale": amax.max()}):  # scalars for 3 experts: eager broadcasts
        fast = quantize(w, scheme, rowwise=True, columnwise=True, **kw)
        assert not calls and fast.rowwise is not None and fast.rowwise.scale.shape == ()
        monkeypatch.setenv(OFF, "0")
        assert_same(fast, quantize(w, scheme, rowwise=True, columnwise=True, **kw))
        monkeypatch.delenv(OFF)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_amax_kernel_equals_eager(dtype):  # type: ignore[no-untyped-def]
    from trainer.kernels import fp8_quant_triton as tq

    w = _weight(6, 200, 1000, dtype, True)  # K beyond one 512-wide amax block
    got = tq.amax(w.contiguous())
    ref = per_tensor.tensor_amax(w.float(), None)
    torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(got[2]) and got[1] == 0 and got[3] == float("inf")
    for counts in ([48, 0, 16, 112, 0, 32], [5, 0, 7, 130, 1], [0, 0, 16]):
        x, groups = _jagged(counts, 700, dtype, True)
        got = tq.amax(x.view(1, *x.shape), groups.ids, groups.count)
        ref = per_tensor.tensor_amax(x.float(), Jagged(groups, -2))
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
        assert all(float(got[i]) == 0 for i, n in enumerate(counts) if n == 0)


@gpu
def test_delayed_recipe_in_pass_amax_matches_eager(monkeypatch):  # type: ignore[no-untyped-def]
    """Delayed scaling: the same bytes, scales and amax histories over successive calls (the amax taken in
    the quantize pass on the fast path, by an eager reduction on the other)."""
    recipe = DelayedRecipe(history_len=3)
    x, groups = _jagged([64, 0, 32, 16], 192, torch.bfloat16, False)
    w = _weight(4, 96, 192, torch.bfloat16, False)
    calls = _spy_kernel(monkeypatch)
    states = {}
    for path in ("fast", "eager"):
        if path == "eager":
            monkeypatch.setenv(OFF, "0")
        st = recipe.new_state(4)
        outs = []
        for step in range(3):
            scale = 1.0 + step  # a moving distribution
            outs.append(recipe.quantize_activation(x * scale, groups=groups, state=st))
            outs.append(recipe.quantize_grad(x * (scale / 7), groups=groups, state=st))
            outs.append(recipe.quantize_weight(w * scale, state=st))
        states[path] = (st, outs)
    assert len(calls) == 9, "the fast path ran for every quantization, and only there"
    monkeypatch.delenv(OFF)
    (st_f, outs_f), (st_e, outs_e) = states["fast"], states["eager"]
    for a, b in zip(outs_f, outs_e):
        assert_same(a, b)
    for h_f, h_e in ((st_f.input, st_e.input), (st_f.grad, st_e.grad), (st_f.weight, st_e.weight)):
        assert torch.equal(h_f.history, h_e.history) and torch.equal(h_f.scale, h_e.scale)


@gpu
def test_quantize_with_amax_returns_the_tensors_amax(monkeypatch):  # type: ignore[no-untyped-def]
    x, groups = _jagged([16, 0, 48], 160, torch.bfloat16, True)
    enc = torch.tensor([2.0, 1.0, 0.5], device="cuda")
    scheme = Scheme("tensor", "e4m3")
    (qf, af), (qe, ae) = _both(
        monkeypatch, lambda: quantize_with_amax(x, scheme, encode_scale=enc, columnwise=True, groups=groups)
    )
    assert_same(qf, qe)
    torch.testing.assert_close(af, ae, rtol=0, atol=0, equal_nan=True)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zero_empty_groups_kernel(dtype):  # type: ignore[no-untyped-def]
    from trainer.kernels import fp8_quant_triton as tq

    out = torch.randn(6, 96, 1000, device="cuda").to(dtype)  # 96000 elements per slab: several programs each
    offs = torch.tensor([16, 16, 48, 48, 48, 64], device="cuda", dtype=torch.int32)
    ref = out.clone()
    ref[1] = 0
    ref[3] = 0
    ref[4] = 0
    tq.zero_empty_groups_(out, offs)
    assert torch.equal(out, ref)
    out = torch.full((3, 4, 5), 7.0, device="cuda", dtype=dtype)
    tq.zero_empty_groups_(out, torch.tensor([0, 0, 9], device="cuda"))  # empty first groups, int64 offsets
    assert torch.count_nonzero(out[:2]) == 0 and bool((out[2] == 7).all())


@gpu
def test_native_grouped_wgrad_is_bf16_with_zero_empty_experts():
    from trainer.precision.gemm import grouped_wgrad

    recipe = TensorwiseRecipe(emulate="never")
    counts = [64, 0, 32, 0]
    T = sum(counts)
    offs = torch.tensor(counts, device="cuda").cumsum(0)
    g = torch.randn(T, 128, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
    gq = recipe.quantize_grad(g, offsets=offs)
    xq = recipe.quantize_activation(x, offsets=offs)
    dw = grouped_wgrad(gq, xq, mode="native")
    ref = grouped_wgrad(gq, xq, mode="emulate")
    assert dw.dtype == torch.bfloat16 and dw.shape == (4, 128, 256) and ref.dtype == torch.float32
    assert torch.count_nonzero(dw[1]) == 0 and torch.count_nonzero(dw[3]) == 0
    assert ((dw.float() - ref).norm() / ref.norm()).item() < 1e-2


def _fused_mlp(recipe, x, w1, w2, probs, counts, overlap=None):  # type: ignore[no-untyped-def]
    """One forward + backward of the fused backend under `recipe` (fresh leaves); (y, dx, dw1, dw2, dprobs)."""
    from moectl.bench.backend_function import BackendFunction
    from trainer.moe.backends.fused import FusedBackend
    from trainer.moe.expert_math import ExpertSpec
    from trainer.moe.expert_precision import ExpertPrecision

    x, w1, w2, probs = (t.detach().clone().requires_grad_() for t in (x, w1, w2, probs))
    spec = ExpertSpec("swiglu", w2.shape[-1], None)
    backend = FusedBackend(x.device, overlap_wgrad=overlap)
    y = BackendFunction.apply(x, w1, w2, probs, counts, backend, spec, lambda: ExpertPrecision(recipe))
    dy = torch.randn(y.shape, device=y.device, generator=torch.Generator(device=y.device).manual_seed(5)).to(y.dtype)
    grads = torch.autograd.grad(y, [x, w1, w2, probs], dy)
    return (y.detach(), *grads)


def _mlp_problem():  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(3)
    counts = torch.tensor([128, 0, 64, 192], device="cuda")
    T, D, F = int(counts.sum()), 256, 384
    x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    w1 = (torch.randn(4, 2 * F, D, device="cuda", generator=g) * D**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(4, D, F, device="cuda", generator=g) * F**-0.5).to(torch.bfloat16)
    probs = torch.rand(T, device="cuda", generator=g)
    return x, w1, w2, probs, counts


@gpu
def test_fast_accum_fp8_expert_mlp_agrees_with_emulation(monkeypatch):  # type: ignore[no-untyped-def]
    """The fused fp8 MLP with fast-accumulating backward GEMMs (all six grouped GEMMs on `_scaled_grouped_mm`
    with use_fast_accum=True) against the exact emulation of the same recipe, and against bf16. With the
    default split accumulation the backward is precise: the two data grads on moectl's precise Triton kernel
    (the faster precise one at these widths, `fp8_grouped_mm_triton.preferred`), the two weight grads on torch's."""
    from trainer.kernels import fp8_grouped_mm_triton

    x, w1, w2, probs, counts = _mlp_problem()
    seen: list[tuple[str, bool]] = []
    real, real_triton = torch._scaled_grouped_mm, fp8_grouped_mm_triton.fp8_grouped_mm

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(("torch", bool(kwargs.get("use_fast_accum"))))
        return real(*args, **kwargs)

    def spy_triton(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(("triton", bool(kwargs.get("fast_accum"))))
        return real_triton(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", spy)
    monkeypatch.setattr(fp8_grouped_mm_triton, "fp8_grouped_mm", spy_triton)
    fast = _fused_mlp(TensorwiseRecipe(emulate="never", fast_accum_backward=True), x, w1, w2, probs, counts)
    assert seen == [("torch", True)] * 6, seen
    seen.clear()
    split = _fused_mlp(TensorwiseRecipe(emulate="never"), x, w1, w2, probs, counts)
    assert seen[:2] == [("torch", True)] * 2, seen  # fprop fast
    assert sorted(seen[2:]) == [("torch", False)] * 2 + [("triton", False)] * 2, seen  # backward precise
    emulated = _fused_mlp(TensorwiseRecipe(emulate="always"), x, w1, w2, probs, counts)
    for name, a, s, e in zip(("y", "dx", "dw1", "dw2", "dprobs"), fast, split, emulated):
        assert torch.isfinite(a).all(), name
        rel = ((a.float() - e.float()).norm() / e.float().norm()).item()
        assert rel < 2e-2, (name, rel)  # fast vs precise accumulation of the same fp8 operands
        rel_split = ((s.float() - e.float()).norm() / e.float().norm()).item()
        assert rel_split < 1e-2, (name, rel_split)


@gpu
def test_fused_fp8_mlp_is_bitwise_the_same_with_eager_quantization(monkeypatch):  # type: ignore[no-untyped-def]
    """End to end: the Triton quantizers change no bit of the fused fp8 MLP's outputs and grads."""
    x, w1, w2, probs, counts = _mlp_problem()
    for recipe in (TensorwiseRecipe(emulate="never", fast_accum_backward=True), DelayedRecipe(emulate="never")):
        fast, ref = _both(monkeypatch, lambda: _fused_mlp(recipe, x, w1, w2, probs, counts))
        for name, a, b in zip(("y", "dx", "dw1", "dw2", "dprobs"), fast, ref):
            assert a.dtype == b.dtype and torch.equal(a, b), name


@gpu
def test_fused_fp8_side_stream_weight_grads_are_bitwise_the_same_and_stream_safe():  # type: ignore[no-untyped-def]
    """The fp8 backward with both weight grads on the side stream equals the one-stream backward bit for bit,
    also when freed memory is reused at once (a block released too early would be overwritten by the NaNs)."""
    x, w1, w2, probs, counts = _mlp_problem()
    for recipe in (TensorwiseRecipe(emulate="never", fast_accum_backward=True), DelayedRecipe(emulate="never")):
        results = []
        for overlap in (False, True, True):
            results.append(_fused_mlp(recipe, x, w1, w2, probs, counts, overlap=overlap))
            scratch = [torch.full_like(w1, float("nan")) for _ in range(3)]
            del scratch
        torch.cuda.synchronize()
        for other in results[1:]:
            for name, a, b in zip(("y", "dx", "dw1", "dw2", "dprobs"), results[0], other):
                assert torch.equal(a, b), name


# ----------------------------------------------------------------------------------------------------------
# CPU: selection and fallbacks


def test_no_fast_path_off_cuda_or_for_other_kinds() -> None:
    x = torch.randn(32, 64)
    assert not triton_fast_path(x, Scheme("tensor", "e4m3"))
    if torch.cuda.is_available():
        xc = x.cuda()
        assert not triton_fast_path(xc, Scheme("row", "e4m3"))
        assert not triton_fast_path(xc, Scheme("mx", "e4m3", (1, 32)))
        assert not triton_fast_path(xc.double(), Scheme("tensor", "e4m3"))


def test_quantize_with_amax_on_cpu_is_the_eager_amax_and_quantize() -> None:
    torch.manual_seed(0)
    x = torch.randn(48, 40)
    groups = TokenGroups.from_offsets(torch.tensor([16, 16, 48]), 48)
    enc = torch.tensor([3.0, 1.0, 0.25])
    scheme = Scheme("tensor", "e4m3")
    q, amax = quantize_with_amax(x, scheme, encode_scale=enc, columnwise=True, groups=groups)
    assert torch.equal(amax, per_tensor.tensor_amax(x, Jagged(groups, -2))) and amax[1] == 0
    assert_same(q, quantize(x, scheme, rowwise=True, columnwise=True, groups=groups, encode_scale=enc))
    with pytest.raises(ValueError, match="per-tensor"):
        quantize_with_amax(x, Scheme("row", "e4m3"), encode_scale=enc)


def test_zero_empty_groups_fallback_on_cpu() -> None:
    from trainer.precision.native import zero_empty_groups_

    out = torch.randn(4, 3, 5).to(torch.bfloat16)
    ref = out.clone()
    ref[0] = 0
    ref[2] = 0
    assert zero_empty_groups_(out, torch.tensor([0, 16, 16, 32])) is out
    assert torch.equal(out, ref)
