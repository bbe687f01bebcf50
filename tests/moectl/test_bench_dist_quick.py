"""`moectl bench optimizer-step --quick` and `moectl bench param-gather --quick` through the CLI (CPU, one gloo
rank), and the param-gather library on two gloo ranks (where the gather really moves bytes)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from dist_helpers import run_distributed
from moectl.bench import param_gather as pg
from moectl.bench.optimizer_step import BYTES_PER_PARAM
from moectl.bench.param_mix import MixShape
from moectl.cli.app import app

GATHERS = {"moectl sync", "moectl async", "raw, one call", "raw, per bucket"}
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


def test_param_gather_quick_one_rank_through_the_cli(tmp_path):
    out = tmp_path / "pg.json"
    result = CliRunner().invoke(app, ["bench", "param-gather", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "param all-gather" in result.output and "exposed" in result.output
    data = json.loads(out.read_text())
    assert data["meta"]["world_size"] == 1
    assert {r["name"] for r in data["gather_rows"]} == GATHERS
    assert {r["name"] for r in data["step_rows"]} == STEPS
    assert not dist.is_initialized()  # the command left no process group behind


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
    for fmt in ("bf16", "fp8", "mxfp8"):
        rows = {r["name"]: r for r in data["gather_rows"] if r["format"] == fmt}
        assert set(rows) == GATHERS
        for r in rows.values():
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] / 2)
            assert r["vs_raw"] == pytest.approx(r["ms"] / rows["raw, one call"]["ms"])
            assert r["gbytes"] * 1e9 == pytest.approx(r["bytes_per_param"] * numel)
            if fmt == "fp8":  # FP8 bytes for the attention and expert weights, bf16 for the rest
                assert 1.0 <= r["qbytes_per_param"] <= 1.02 and 1.0 < r["bytes_per_param"] < 2.0
            else:
                assert r["bytes_per_param"] >= 2.0  # bf16 (mxfp8: staged bf16), plus bucket padding
    step = {r["name"]: r for r in data["step_rows"]}
    assert set(step) == STEPS and step["compute only"]["exposed_ms"] == 0
    assert data["meta"]["step"]["grad_reduce_gbytes"] > 0
