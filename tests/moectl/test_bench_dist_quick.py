"""`moectl bench optimizer-step --quick` and `moectl bench param-gather --quick` through the CLI (CPU, one gloo
rank), and the param-gather library on two gloo ranks (where the gather really moves bytes)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from dist_helpers import run_distributed
from moectl.bench import param_gather as pg
from moectl.bench.optimizer_step import BYTES_PER_PARAM
from moectl.bench.param_mix import MixShape
from moectl.cli.app import app
from trainer.distributed.param_gather import is_block_linear

GATHERS = {"moectl sync", "moectl sync, per bucket", "moectl async", "raw, one call", "raw, per bucket",
           "raw, per bucket, coalesced"}
BUILDS = {"columnwise build (torch)"}  # fp8 only (and two Triton tiles on CUDA): not gathers
STEPS = {"overlap on", "overlap off", "compute only"}


def test_optimizer_step_quick_writes_consistent_json(tmp_path):
    out = tmp_path / "opt.json"
    result = CliRunner().invoke(app, ["bench", "optimizer-step", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "optimizer step" in result.output and "vs torch" in result.output
    data = json.loads(out.read_text())
    n = MixShape.quick().numel()
    assert data["meta"]["shape"]["numel"] == n and data["meta"]["device"] == "cpu"
    rows = {r["key"]: r for r in data["rows"]}
    assert {"torch_fused", "moectl_fp32", "moectl_bf16", "grad norm", "write-back"} <= set(rows)
    torch_ms = rows["torch_fused"]["ms"]
    for key, b in BYTES_PER_PARAM.items():
        r = rows[key]
        assert r["ms"] > 0 and r["bytes_per_param"] == b
        assert r["floor_ms"] == pytest.approx(b * n / (data["copy_gbps"] * 1e9) * 1e3)
        assert r["throughput_vs_torch"] == pytest.approx(torch_ms / r["ms"])
    assert any("0.8x" in note for note in data["notes"])
    for key in ("muon_ns_bf16", "muon_ns_fp32"):  # Muon's step on the same params, against torch fused AdamW
        r = rows[key]
        assert r["ms"] > 0 and r["bytes_per_param"] is None and r["ns_tflops_per_s"] > 0
        assert r["throughput_vs_torch"] == pytest.approx(torch_ms / r["ms"])
    assert rows["muon update"]["ms"] > 0 and "Muon" in result.output
    assert any(note.startswith("Muon step:") for note in data["notes"])


def test_optimizer_step_rows_describe_the_step_without_write_back_or_host_sync():
    """The fused (CUDA) step's path on the CPU: fp32 masters are the params, so the parts are the norm, the
    step's own gated update and the bf16 step's write-back, with the bytes each moves."""
    from moectl.bench import optimizer_step as ob

    assert BYTES_PER_PARAM == {"torch_fused": 28, "moectl_fp32": 32, "moectl_bf16": 38}
    cfg = ob.OptBenchConfig.quick()
    cfg.fused, cfg.quant_recipes, cfg.rounds = True, (), 1
    result = ob.run(cfg)
    rows = {r["key"]: r for r in result.rows}
    assert {k: rows[k]["bytes_per_param"] for k in ob.PART_BYTES_PER_PARAM} == {"grad norm": 4, "update": 28,
                                                                              "write-back": 6}
    assert rows["write-back"]["name"].strip() == "bf16 step part: write-back"
    assert rows["update"]["ms"] > 0 and rows["grad norm"]["ms"] > 0
    assert any("norm + update alone" in n for n in result.notes)


def test_param_gather_quick_one_rank_through_the_cli(tmp_path):
    out = tmp_path / "pg.json"
    result = CliRunner().invoke(app, ["bench", "param-gather", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "param all-gather" in result.output and "exposed" in result.output
    data = json.loads(out.read_text())
    assert data["meta"]["world_size"] == 1 and data["meta"]["mix"] == "default"
    assert {r["name"] for r in data["gather_rows"]} == GATHERS | BUILDS
    assert data["meta"]["coalesced_equals_per_bucket"] == {"bf16": True, "fp8": True, "mxfp8": True}
    assert {r["name"] for r in data["step_rows"]} == STEPS
    assert not dist.is_initialized()  # the command left no process group behind


def test_param_gather_quick_large_moe_mix(tmp_path):
    out = tmp_path / "pg.json"
    result = CliRunner().invoke(app, ["bench", "param-gather", "--quick", "--no-step", "--mix", "large-moe",
                                      "--json", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "large-moe mix" in result.output
    data = json.loads(out.read_text())
    assert data["meta"]["mix"] == "large-moe" and data["step_rows"] == []
    assert data["meta"]["shape"]["numel"] == MixShape.large_moe_quick().numel()
    assert MixShape.large_moe().embedding_head_share() < 0.04 < MixShape.default().embedding_head_share()
    assert MixShape.large_moe().numel() <= 2.5e9
    bad = CliRunner().invoke(app, ["bench", "param-gather", "--quick", "--mix", "huge"])
    assert bad.exit_code == 2 and "large-moe" in bad.output


def _two_ranks(rank: int, world_size: int) -> dict:
    cfg = pg.GatherBenchConfig.quick("cpu")
    return pg.run(cfg, torch.device("cpu")).to_json()


@pytest.mark.slow
def test_param_gather_on_two_gloo_ranks():
    results = run_distributed(_two_ranks, world_size=2, timeout=120)
    assert results[0] == results[1]  # every rank reports the slowest rank's medians
    data = results[0]
    numel = MixShape.quick().numel()
    assert {r["format"] for r in data["gather_rows"]} == {"bf16", "fp8", "mxfp8"}
    assert data["meta"]["coalesced_equals_per_bucket"] == {"bf16": True, "fp8": True, "mxfp8": True}
    bf16 = {r["name"]: r for r in data["gather_rows"] if r["format"] == "bf16"}
    quantized = sum(math.prod(shape) for name, shape, _ in MixShape.quick().shapes() if is_block_linear(name))
    for fmt in ("bf16", "fp8", "mxfp8"):
        rows = {r["name"]: r for r in data["gather_rows"] if r["format"] == fmt}
        assert set(rows) == GATHERS | (BUILDS if fmt == "fp8" else set())
        for name, r in rows.items():
            if name in BUILDS:  # bytes read + written by the transposes: twice the quantized bytes
                assert r["busbw_gbps"] is None and r["vs_raw"] is None and r["vs_bf16"] is None
                assert r["gbytes"] * 1e9 == pytest.approx(2 * quantized)
                continue
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] / 2)
            assert r["vs_raw"] == pytest.approx(r["ms"] / rows["raw, one call"]["ms"])
            assert r["gbytes"] * 1e9 == pytest.approx(r["bytes_per_param"] * numel)
            assert r["vs_bf16"] == (None if fmt == "bf16" else pytest.approx(r["ms"] / bf16[name]["ms"]))
            if fmt == "fp8":  # FP8 bytes for the attention and expert weights, bf16 for the rest
                assert 1.0 <= r["qbytes_per_param"] <= 1.02 and 1.0 < r["bytes_per_param"] < 2.0
            else:
                assert r["bytes_per_param"] >= 2.0  # bf16 (mxfp8: staged bf16), plus bucket padding
    step = {r["name"]: r for r in data["step_rows"]}
    assert set(step) == STEPS and step["compute only"]["exposed_ms"] == 0
    assert data["meta"]["step"]["grad_reduce_gbytes"] > 0


def test_param_gather_without_quick_on_a_cpu_says_it_is_gpu_sized(monkeypatch):
    """`moectl bench param-gather` on a CPU built the 803.5M-param mix and ran silently for minutes (grouped-mlp
    says so; optimizer-step refuses on host memory); the note comes before any work."""
    import torch

    from moectl.bench import param_gather as pg
    from moectl.core.errors import MoectlError

    def stop(*a, **kw):
        raise MoectlError("stopped here by the test")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(pg, "run", stop)
    result = CliRunner().invoke(app, ["bench", "param-gather"])
    assert result.exit_code == 1, result.output
    assert ("note: the default mix (804M params) is GPU-sized and runs for a long time on the CPU before the first "
            "row; --quick is the CPU smoke test") in " ".join(result.output.split())
