"""`moectl bench train` on a GPU: every column runs (inductor compiles), and the category table holds on the
real kernel names: GEMMs, attention and the optimizer are found, nothing GEMM- or attention-like is left in
the elementwise bucket, and in the columns launched eagerly almost all device time is attributed to a region
(`ours` replays its micro-batches from CUDA graphs, whose kernels carry no region).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moectl.cli.app import app

REFERENCE = Path(__file__).resolve().parents[2] / "configs" / "bench_reference.yaml"
SMALLER = ["model.num_layers=2", "model.seq_length=1024", "train.global_batch_size=4"]


@pytest.mark.gpu
def test_reference_structure_on_gpu(tmp_path):
    out = tmp_path / "train.json"
    args = ["bench", "train", str(REFERENCE), "--steps", "3", "--warmup", "2", "--profile-steps", "1",
            "--json", str(out)] + [a for s in SMALLER for a in ("--set", s)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    print(result.output)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    rows = {r["column"]: r for r in data["rows"]}
    assert set(rows) == {"ours", "compiled-peer", "torchtitan-recipe"}
    assert rows["torchtitan-recipe"]["expert_backend"] == "grouped"
    # on CUDA the default compiles too: 2 layers' norms, attention and router, the final norm, the cross-entropy
    assert rows["ours"]["compiled_regions"] == rows["compiled-peer"]["compiled_regions"] == 2 * 4 + 2
    for name, r in rows.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["mfu"] is not None and 0 < r["mfu"] < 1, name  # H100/H200 have a known peak
        assert r["peak_mem_gib"] > 1 and r["reserved_gib"] >= r["peak_mem_gib"]
        p = r["profile"]
        cats = p["category_ms"]
        for key in ("dense_gemm", "grouped_gemm", "attention", "optimizer", "elementwise"):  # by kernel name
            assert cats[key] > 0, (name, key)
        # nothing that looks like a GEMM or attention kernel fell through to elementwise
        for k in p["top"].get("elementwise", []):
            assert not re.search(r"nvjet|xmma|gemm|flash|fmha|cutlass", k["name"], re.I), (name, k)
        assert p["busy_ms"] <= 1.05 * r["step_ms"]  # a profiled step's device work fits in an unprofiled step
        # bf16, same seed and batches: the compiled columns train the same losses within bf16 noise
        assert r["loss_vs_first_column"] < 0.05, name
        if r["cuda_graph"]:  # replayed kernels have no launching op, so no region (the table's note says so)
            assert name == "ours" and p["unattributed_ms"] > 0.5 * p["busy_ms"], (name, p["unattributed_ms"])
        else:
            assert cats["loss"] > 0, name  # by region
            assert p["unattributed_ms"] < 0.05 * p["busy_ms"], (name, p["unattributed_ms"], p["busy_ms"])
