"""CPU smoke tests of the fp8 columns of `moectl bench grouped-mlp` and the quantize rows of `moectl bench
optimizer-step` (--quick: tiny shapes; the fp8 GEMMs are emulated on CPU and the tables must say so)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from moectl.bench import grouped_mlp_fp8 as fp8
from moectl.bench.grouped_mlp import FP8_PATHS, QUICK_SHAPES
from moectl.cli.app import app

RUN_FP8 = ["fused", "fp8_tensorwise", "fp8_tensorwise_pq", "fp8_tensorwise_pq_fa", "fp8_delayed_pq_fa", "fp8_rowwise",
           "sgmm_rowwise", "torchao_rowwise"]  # fmt: skip
OURS = ("fp8_tensorwise", "fp8_tensorwise_pq", "fp8_tensorwise_pq_fa", "fp8_delayed_pq_fa", "fp8_rowwise")


def test_quick_fp8_columns_on_cpu_are_emulated_and_say_so(tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "grouped-mlp", "--quick", "--device", "cpu", "--no-permute", "--json", str(out),
            "--profile", "fp8_tensorwise"]  # fmt: skip
    for p in RUN_FP8:
        args += ["--path", p]
    result = CliRunner(env={"COLUMNS": "250"}).invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "fp8 expert MLP" in result.output
    assert "fp8 columns EMULATED on cpu" in result.output and "EMUL" in result.output
    assert "torchao fp8 rowwise: not run on cpu" in result.output
    assert "profile fp8_tensorwise fwd+bwd" in result.output

    data = json.loads(out.read_text())
    assert data["meta"]["fp8_modes"] == {
        **{p: "emulated" for p in OURS}, "sgmm_rowwise": "emulated", "torchao_rowwise": "not run",
    }  # fmt: skip
    rows = data["rows"]
    assert len(rows) == len(QUICK_SHAPES) * 2
    for row in rows:
        for path in (*OURS, "sgmm_rowwise"):
            assert row[f"{path}_ms"] > 0 and row[f"{path}_mode"] == "emulated"
            assert row[f"{path}_vs_fused"] == row["fused_ms"] / row[f"{path}_ms"]
            err = row[f"{path}_rel_err"]
            # the same function as the eager path, within fp8 rounding (e4m3: 3 mantissa bits)
            assert set(err) == {"y", "dx", "dw1"} and all(0 < e < 0.15 for e in err.values()), (path, err)
        assert row["torchao_rowwise_ms"] is None and row["torchao_rowwise_mode"] is None
        assert row["fp8_rowwise_vs_sgmm_rowwise"] == row["sgmm_rowwise_ms"] / row["fp8_rowwise_ms"]
    prof = data["profiles"]["fp8_tensorwise"]
    assert prof["total_ms"] > 0 and 0 < prof["gemm_ms"] <= prof["total_ms"]


def test_no_fp8_drops_the_columns():
    result = CliRunner().invoke(app, ["bench", "grouped-mlp", "--quick", "--device", "cpu", "--no-permute",
                                      "--path", "fused", "--path", "fp8_tensorwise", "--no-fp8"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "fp8 expert MLP" not in result.output


def test_profile_of_a_path_not_run_is_a_usage_error():
    result = CliRunner().invoke(app, ["bench", "grouped-mlp", "--quick", "--path", "fused", "--profile", "fp8_rowwise"])
    assert result.exit_code != 0
    assert "--profile" in result.output


@pytest.mark.parametrize("num_groups", [1, 3])
def test_sgmm_baseline_emulation_matches_a_float64_reference(num_groups):
    """The unfused baseline (emulated on CPU) computes x w^T per group, and its grads, within fp8 rounding;
    an empty group gets a zero weight grad."""
    g = torch.Generator().manual_seed(0)
    T, K, N = 16 * (num_groups + 1), 32, 48
    counts = torch.tensor([16] * num_groups + [16], dtype=torch.int64)
    if num_groups == 3:
        counts = torch.tensor([32, 0, 16, 16])  # an expert with no rows
    E = counts.numel()
    offs = torch.cumsum(counts, 0).to(torch.int32)
    expert_T = torch.repeat_interleave(torch.arange(E), counts)
    x = torch.randn(T, K, generator=g, requires_grad=True)
    w = torch.randn(E, N, K, generator=g, requires_grad=True)
    dy = torch.randn(T, N, generator=g)
    y = fp8.Fp8RowwiseGroupedMM.apply(x, w, offs, expert_T, torch.float32)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    ref_y = torch.einsum("tk,tnk->tn", x64, w64[expert_T])
    ref_dx = torch.einsum("tn,tnk->tk", dy64, w64[expert_T])
    ref_dw = torch.zeros_like(w64).index_add_(0, expert_T, torch.einsum("tn,tk->tnk", dy64, x64))
    for got, ref in ((y, ref_y), (dx, ref_dx), (dw, ref_dw)):
        rel = float((got.detach().double() - ref).norm() / ref.norm())
        assert rel < 0.08, rel
    if num_groups == 3:
        assert torch.count_nonzero(dw[1]) == 0


def test_rowwise_quantizer_uses_pow2_scales_and_saturates():
    x = torch.tensor([[1.0, -3.0, 0.5], [0.0, 0.0, 0.0], [1e4, 2.0, -1.0]])
    data, decode = fp8._rowwise(x, -1)
    enc = decode.reciprocal()
    assert torch.equal(torch.exp2(torch.log2(enc).round()), enc)  # powers of two
    assert enc[1].item() == 1.0 and torch.count_nonzero(data[1].float()) == 0  # all-zero row: scale 1
    assert data.float().abs().max() <= fp8.E4M3_MAX
    assert enc[0].item() == 128.0  # 448 / 3 = 149.3 -> rounded down to 2^7


def test_kernel_names_are_split_into_gemms_and_the_rest():
    assert fp8.is_gemm("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversal")
    assert fp8.is_gemm("nvjet_tst_128x256") and fp8.is_gemm("aten::_scaled_grouped_mm")
    assert not fp8.is_gemm("void at::native::vectorized_elementwise_kernel<4, at::native::AbsFunctor<float>>")
    assert not fp8.is_gemm("_triton_fp8_rowwise_2d_fused_scale_and_cast_kernel")


def test_optimizer_step_quick_has_the_grouped_quantize_rows(tmp_path):
    out = tmp_path / "opt.json"
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["bench", "optimizer-step", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "post-step quantize of one grouped expert weight [128, 32, 64]" in result.output
    data = json.loads(out.read_text())
    rows = {(r["recipe"], r["how"]): r for r in data["quant_rows"]}
    assert set(rows) == {(r, h) for r in ("mxfp8", "tensorwise") for h in ("grouped", "loop")}
    for recipe in ("mxfp8", "tensorwise"):
        grouped, loop = rows[(recipe, "grouped")], rows[(recipe, "loop")]
        assert grouped["experts"] == 128 and grouped["ms"] > 0 and loop["ms"] > 0
        assert grouped["grouped_speedup"] == loop["ms"] / grouped["ms"] and loop["grouped_speedup"] is None
    assert any("checked equal" in n for n in data["notes"])


def test_fp8_paths_are_all_labelled():
    assert set(fp8.LABELS) == set(FP8_PATHS)
