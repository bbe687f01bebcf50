"""`moectl bench train`: the quick CPU run through the CLI, how a column's config is made, error rows, and
the aggregate vs per-GPU numbers of a two-rank run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dist_helpers import run_distributed
from moectl.bench import train_bench as tb
from moectl.bench.kernel_classes import CATEGORIES
from moectl.bench.train_columns import COLUMNS, pick
from moectl.cli.app import app

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
REFERENCE = REPO / "configs" / "bench_reference.yaml"


def test_quick_run_writes_every_measure_for_each_column(tmp_path):
    out = tmp_path / "train.json"
    result = CliRunner().invoke(app, [
        "bench", "train", str(TINY), "--quick", "--column", "ours", "--column", "torchtitan-recipe", "--set",
        "moe.backend=loop", "--set", "data.source=synthetic", "--warmup", "0", "--steps", "2", "--json", str(out),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "training step" in result.output and "aot_eager" in result.output
    data = json.loads(out.read_text())
    assert data["meta"]["world_size"] == 1 and data["meta"]["device"] == "cpu" and data["meta"]["quick"]
    host = data["meta"]["host_cpu"]  # the peers are host-bound: a recorded number names its host
    assert host and f"host {host}" in " ".join(result.output.split())
    assert data["meta"]["model"]["params"] > data["meta"]["model"]["active_params"] > 0
    ours, titan = data["rows"]
    assert (ours["column"], titan["column"]) == ("ours", "torchtitan-recipe")
    # the user's --set reaches every column, a column's own overrides win over it
    assert (ours["expert_backend"], titan["expert_backend"]) == ("loop", "grouped")
    # 2 layers: norms, attention, router each; the final norm and the cross-entropy once
    assert ours["compiled_regions"] == 0 and titan["compiled_regions"] == 2 * 4 + 2
    for r in (ours, titan):
        assert len(r["step_ms_all"]) == 2 and r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"]
        assert r["tokens_per_s"] == pytest.approx(data["meta"]["model"]["tokens_per_step"] / (r["step_ms"] * 1e-3))
        assert r["tokens_per_s_per_gpu"] == r["tokens_per_s"]
        assert r["mfu"] is None and r["peak_mem_gib"] is None and r["reserved_gib"] is None  # CPU: no peak to compare with, no CUDA allocator
        prof = r["profile"]
        assert set(prof["category_ms"]) == set(CATEGORIES) and prof["busy_ms"] > 0
        assert prof["category_ms"]["grouped_gemm"] > 0 and prof["category_ms"]["attention"] > 0
    assert ours["ours_speedup"] == 1.0 and titan["ours_speedup"] == pytest.approx(titan["tokens_per_s"] and
                                                                                ours["tokens_per_s"] / titan["tokens_per_s"])
    # the same seed and batches: the compiled grouped column trains the same losses (fp32, aot_eager)
    assert titan["loss_vs_first_column"] < 1e-4


def test_column_config_layers_and_bad_column():
    bench = tb.TrainBenchConfig(config=REFERENCE, sets=["moe.router_topk=1"], steps=4, warmup=2, profile_steps=1,
                                quick=True)  # fmt: skip
    cfg = tb.column_config(bench, COLUMNS["torchtitan-recipe"], world_size=2)
    # the quick shrink of the reference config: its structure, tiny and on the CPU
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.train.device) == (2, 64, "cpu")
    assert cfg.model.num_attention_heads // cfg.model.kv_heads == 4  # 16 heads in 4 groups -> 4 per group
    assert cfg.moe.num_experts == 8 and cfg.train.global_batch_size == 2 * 2 * 2  # 2 micro-batches per rank
    assert cfg.moe.router_topk == 1  # the user's --set beats the shrink
    assert (cfg.train.compile, cfg.moe.backend) == ("regional", "grouped")  # the column beats both
    assert cfg.train.eval_interval is None and cfg.checkpoint.save_interval is None
    full = tb.column_config(tb.TrainBenchConfig(config=REFERENCE), COLUMNS["ours"])
    assert (full.model.num_layers, full.moe.num_experts, full.train.compile) == (8, 32, "auto")
    with pytest.raises(ValueError, match="unknown column"):
        pick(["ours", "fastest"])
    result = CliRunner().invoke(app, ["bench", "train", str(TINY), "--quick", "--column", "fastest"])
    assert result.exit_code == 2 and "unknown column" in result.output and "Traceback" not in result.output
    with pytest.raises(ValueError, match=r"unknown column\(s\) \['ourss'\] \(did you mean 'ours'\?\)"):
        pick(["ourss"])


def test_a_column_that_runs_out_of_memory_is_a_row_not_a_traceback(monkeypatch):
    real = tb.measure_column

    def measure(cfg, column, bench, log):
        if column.name == "compiled-peer":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 GiB. GPU 0 has 13.2 GiB free")
        return real(cfg, column, bench, log)

    monkeypatch.setattr(tb, "measure_column", measure)
    bench = tb.TrainBenchConfig(config=TINY, columns=pick(["ours", "compiled-peer"]), quick=True, steps=1, warmup=0,
                                profile_steps=0)  # fmt: skip
    configs = [tb.column_config(bench, c) for c in bench.columns]
    result = tb.run(bench, configs, {})
    ours, peer = result.rows
    assert ours["tokens_per_s"] > 0 and "error" not in ours
    assert peer["error"].startswith("out of memory: CUDA out of memory. Tried to allocate 14.00 GiB")
    assert peer["ours_speedup"] is None and "tokens_per_s" not in peer
    from moectl.cli.bench_train import _rows

    cells = dict(_rows(result))
    assert cells["tokens/s"][1] == peer["error"]


def _two_ranks(rank: int, world_size: int) -> dict:
    bench = tb.TrainBenchConfig(config=TINY, sets=["data.source=synthetic"], columns=pick(["ours"]), quick=True,
                                steps=2, warmup=0, profile_steps=0)  # fmt: skip
    result = tb.run(bench, [tb.column_config(bench, c, world_size) for c in bench.columns], {})
    return result.rows[0]


@pytest.mark.slow
def test_two_ranks_report_the_job_and_per_gpu_rates():
    rank0, rank1 = run_distributed(_two_ranks, world_size=2)
    assert rank0["model"]["world_size"] == 2
    assert rank0["model"]["tokens_per_step"] == 2 * 2 * 2 * 64  # 2 micro-batches of 2 sequences per rank
    assert rank0["tokens_per_s_per_gpu"] == pytest.approx(rank0["tokens_per_s"] / 2)
    assert rank0["losses"] == rank1["losses"]  # the loss is averaged over data-parallel ranks


def test_the_optimizer_columns_set_the_optimizer_and_nothing_else():
    bench = tb.TrainBenchConfig(config=TINY, sets=["optimizer.optimizer=sgd"])
    for name in ("muon", "adam"):
        cfg = tb.column_config(bench, COLUMNS[name])
        ours = tb.column_config(bench, COLUMNS["ours"])
        assert cfg.optimizer.optimizer == name and ours.optimizer.optimizer == "sgd"  # the column beats --set
        assert (cfg.train, cfg.moe, cfg.model) == (ours.train, ours.moe, ours.model)
    rows = [{"column": "adam", "tokens_per_s": 200.0}, {"column": "muon", "tokens_per_s": 157.0}]
    tb.add_ratios(rows)
    assert [r["vs_first"] for r in rows] == [1.0, 157.0 / 200.0] and rows[1]["ours_speedup"] is None
    # table order: adam first, so muon's row says its fraction of adam's speed
    assert [c.name for c in pick(["muon", "adam"])] == ["adam", "muon"] and "muon" not in [c.name for c in pick(None)]


def test_without_a_profile_the_table_says_nothing_of_device_time(tmp_path):
    """`--profile-steps 0` dropped the device-time rows but kept the caption on how they are computed and the
    CPU note on attributing them."""
    args = ["bench", "train", str(TINY), "--quick", "--steps", "1", "--warmup", "0"]
    res = CliRunner().invoke(app, [*args, "--profile-steps", "0"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert "no profile (--profile-steps 0)" in res.output
    assert "device time from a profile" not in res.output and "the split only shows" not in res.output
    res = CliRunner().invoke(app, [*args, "--profile-steps", "1"], env={"COLUMNS": "400"})
    assert res.exit_code == 0 and "device time from a profile of 1 more" in res.output, res.output


def test_data_that_cannot_be_read_is_bad_input_not_an_error_row(tmp_path):
    """Every column reads the same data: a data.path that does not exist ended the bench 0, each column an error
    row; `train` refuses the same config with exit 2, one line naming the file."""
    missing = tmp_path / "nope.bin"
    res = CliRunner().invoke(app, ["bench", "train", str(TINY), "--quick", "--column", "ours", "--set",
                                   "data.source=tokens", "--set", f"data.path={missing}"])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert f"error: {missing}: no such file" in res.output and "training step" not in res.output


def test_a_warning_of_the_config_is_printed_once_not_once_per_column(tmp_path):
    """Each column's config is checked: a missing data.path was MOE045 three times, once per default column."""
    res = CliRunner().invoke(app, ["bench", "train", str(TINY), "--quick", "--set", "data.source=tokens", "--set",
                                   f"data.path={tmp_path / 'nope.bin'}"], env={"COLUMNS": "400"})  # fmt: skip
    assert res.exit_code == 2 and res.output.count("MOE045") == 1, res.output


@pytest.mark.parametrize("bad", [["--column", "fastest"], ["--set", "train.global_batch_size=6"]])
def test_a_launched_bench_refuses_a_bad_column_or_config_before_starting(monkeypatch, bad):
    """Under --nproc-per-node the columns and rules were checked by each worker, after torchrun's start-up: one
    error line per worker. Now the launcher refuses before starting any process, as `train` does."""
    import moectl.cli.launch as launch

    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: pytest.fail("launched a refused bench"))
    res = CliRunner().invoke(app, ["bench", "train", str(TINY), "--quick", "--nproc-per-node", "2", *bad])
    assert res.exit_code == 2, res.output
    assert res.output.count("error:") == 1 + (bad[0] == "--set"), res.output  # a rule: its line, then the refusal
