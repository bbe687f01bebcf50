"""`moectl bench grouped-mlp --quick` end to end through the CLI (CPU, fp32, tiny shapes): the CI smoke test."""

from __future__ import annotations

import json

import pytest
import torch

from typer.testing import CliRunner

from moectl.bench.grouped_mlp import PATHS, QUICK_SHAPES
from moectl.cli.app import app


def test_quick_bench_writes_json_with_every_column(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "grouped-mlp", "--quick", "--device", "cpu", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "grouped expert MLP" in result.output and "compile skipped on CPU" in result.output

    data = json.loads(out.read_text())
    assert data["meta"]["device"] == "cpu" and data["meta"]["dtype"] == "float32"
    assert data["ceiling_tflops"] > 0
    rows = data["rows"]
    # every shape x {fwd, fwd+bwd} x {experts only, with permute}
    assert len(rows) == len(QUICK_SHAPES) * 4
    assert {(r["pass"], r["permute"]) for r in rows} == {(p, q) for p in ("fwd", "fwd+bwd") for q in (False, True)}
    for row in rows:
        for key in ("experts", "hidden", "ffn", "tokens_per_expert", "gemm_tflop", "fused_vs_eager", "dense_row_tflops"):
            assert key in row
        for path in PATHS:
            for suffix in ("ms", "tflops", "pct_ceiling"):
                assert f"{path}_{suffix}" in row
        for path in ("loop", "eager", "grouped", "fused"):
            assert row[f"{path}_tflops"] > 0
            assert abs(row[f"{path}_pct_ceiling"] - 100 * row[f"{path}_tflops"] / data["ceiling_tflops"]) < 1e-6
        assert row["compile_tflops"] is None  # skipped on CPU in quick mode, and the table says so
        # the host-ahead regime is CUDA-only: present in the JSON, empty on the CPU
        assert row["fused_queued_ms"] is None and row["queued_host_behind"] == []
        assert row["fused_sustained_ms"] is None  # so is the steady-state one
        assert row["fused_vs_eager"] == row["eager_ms"] / row["fused_ms"]
        # the Transformer Engine column: CUDA only, so empty here, and the notes say why
        assert row["te_tflops"] is None and row["fused_vs_te"] is None and row["fp8_tensorwise_vs_te"] is None
    assert any(n.startswith("te: not run on cpu") for n in data["notes"])


def test_te_columns_say_why_they_do_not_run(monkeypatch):
    from moectl.bench import te_paths

    assert te_paths.available("te", torch.device("cpu"))[0] is False
    te_paths._te_import_error.cache_clear()
    monkeypatch.setattr(te_paths, "_te_import_error", lambda: "moe.backend=te could not import Transformer Engine")
    ok, why = te_paths.available("te_fp8_tensorwise", torch.device("cuda"))
    assert not ok and "could not import" in why and "gpu_te_setup.sh" in why


def test_bad_shape_is_a_one_line_usage_error():
    result = CliRunner().invoke(app, ["bench", "grouped-mlp", "--quick", "--shape", "8,4096"])
    assert result.exit_code == 2
    assert "expected four positive integers" in result.output
    # a shape no path could run (95 is no multiple of 8) and a word: the usage error, not a traceback mid-run
    # and one whose tensors no int64 size can hold: "Overflow when unpacking long long" from torch.randperm
    for shape, says in (("4,64,95,32", "multiples of 8"), ("a,b,c,d", "expected four positive integers"),
                        ("4,8,8,99999999999999999999", "more than torch can address")):
        result = CliRunner().invoke(app, ["bench", "grouped-mlp", "--quick", "--shape", shape])
        assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("bench", ["grouped-mlp", "optimizer-step", "param-gather"])
@pytest.mark.parametrize("device", ["tpu", "cuda"])
def test_a_device_the_bench_cannot_use_is_one_line(bench: str, device: str) -> None:
    """A wrong --device, or cuda without a GPU, ended in a traceback from inside the bench."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    res = CliRunner().invoke(app, ["bench", bench, "--quick", "--device", device])
    assert res.exit_code == 2 and "error: --device" in res.output and "Traceback" not in res.output, res.output


def test_a_cpu_optimizer_bench_that_cannot_fit_is_refused_not_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    """803.5M params on a 23 GiB machine: the OOM killer ended the run with exit 137 and no word."""
    from moectl.bench import optimizer_step as ob
    from moectl.core.errors import UsageError

    monkeypatch.setattr(ob, "host_memory_available", lambda: 8 << 30)
    with pytest.raises(UsageError, match="need about 48 GiB of host memory"):
        ob.check_fits(ob.OptBenchConfig(device="cpu"))
    ob.check_fits(ob.OptBenchConfig.quick())  # the quick mix fits
    monkeypatch.setattr(ob, "host_memory_available", lambda: None)  # unknown: not refused
    ob.check_fits(ob.OptBenchConfig(device="cpu"))
