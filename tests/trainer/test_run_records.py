"""What a run records besides metrics.jsonl's losses: TensorBoard event files and the MFU figure.

- TensorBoard: the event files a run writes under run_dir/tb hold every numeric record of metrics.jsonl,
  train and eval, at its step (TensorBoard stores scalars as float32; the values are compared at that
  precision), read back with TensorBoard's own event reader.
- MFU: on a known config (configs/tiny.yaml) the model FLOPs per token are counted by hand here, and the
  figure in metrics.jsonl is those FLOPs at the measured tokens/s over the device's dense peak. CPUs have
  no peak (no `mfu` key), so the test fakes the device peak the loop looks up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import trainer.loop as loop
from moectl.core.config.load import load_config
from trainer.flops import flops_per_token, peak_tflops
from trainer.loop import Trainer
from trainer.observer import SilentObserver

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=16", "moe.ffn_hidden_size=16", "train.micro_batch_size=2", "train.global_batch_size=4",
    "data.source=synthetic", "train.device=cpu", "train.eval_interval=2", "train.eval_iters=1",
]  # fmt: skip


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_events_hold_every_record(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    Trainer(load_config(None, [*SMALL, f"run_dir={tmp_path}", "train.train_iters=3", "logging.tensorboard=true"]),
            SilentObserver()).run()  # fmt: skip
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    want: dict[str, list[tuple[int, float]]] = {}
    for rec in records(tmp_path):
        for key, value in rec.items():
            if key != "step" and isinstance(value, (int, float)):
                want.setdefault(key, []).append((rec["step"], float(value)))
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "aux_loss", "expert_balance", "eval_loss"} <= set(want)
    assert sorted(events.Tags()["scalars"]) == sorted(want)
    for tag, points in want.items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        for (_, g), (_, w) in zip(got, points):
            assert g == torch.tensor(w, dtype=torch.float32).item(), (tag, g, w)  # float32 storage
    assert [s for s, _ in want["eval_loss"]] == [2, 3]  # every eval_interval, and at the end


# Hand count for configs/tiny.yaml (D 64, 4 heads of 16 over 2 kv groups, 2 MoE layers, 4 swiglu experts of
# F 64, top-2, vocab 256, seq 128), per token, forward + backward (trainer/flops.py's convention):
ATTENTION = 2 * ((4 + 2 * 2) * 16 * 64 + 4 * 16 * 64)  # qkv + proj, 2 layers: 24576
ROUTER = 2 * 4 * 64  # 512
ACTIVE_EXPERTS = 2 * 2 * (2 * 64 * 64 + 64 * 64)  # 2 layers x top-2 x (fc1 [2F, D] + fc2 [D, F]): 49152
HEAD = 256 * 64  # the output head (the embedding lookup is no matmul): 16384
TINY_FLOPS_PER_TOKEN = 6 * (ATTENTION + ROUTER + ACTIVE_EXPERTS + HEAD) + 12 * 2 * 128 * 64  # 740352


def test_flops_per_token_of_the_tiny_config_by_hand() -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    assert TINY_FLOPS_PER_TOKEN == 740352
    assert flops_per_token(cfg.model, cfg.moe) == TINY_FLOPS_PER_TOKEN


def test_mfu_is_model_flops_at_the_measured_rate_over_the_device_peak(tmp_path: Path, monkeypatch) -> None:
    asked: list[tuple[str, str]] = []
    peak = 2e-3  # TFLOP/s: a faked device, so the figure is well above 0 on a CPU

    def fake_peak(device: torch.device, precision: str = "bf16") -> float:
        asked.append((device.type, precision))
        return peak

    monkeypatch.setattr(loop, "peak_tflops", fake_peak)
    # the tiny model as shipped; only the run is shortened (batch size does not change FLOPs per token)
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"run_dir={tmp_path}", "train.train_iters=2",
                                                        "train.global_batch_size=4", "train.eval_interval=null",
                                                        "data.source=synthetic"])  # fmt: skip
    Trainer(cfg, SilentObserver()).run()
    assert asked == [("cpu", "bf16")]  # no fp8 recipe: the bf16 peak
    recs = records(tmp_path)
    assert len(recs) == 2
    for r in recs:
        want = TINY_FLOPS_PER_TOKEN * r["tokens_per_s"] / (peak * 1e12 * 1)  # one rank
        assert r["mfu"] == pytest.approx(want, rel=1e-12)
        assert 0 < r["mfu"]


def test_no_mfu_without_a_known_peak(tmp_path: Path) -> None:
    Trainer(load_config(None, [*SMALL, f"run_dir={tmp_path}", "train.train_iters=1"]), SilentObserver()).run()
    assert "mfu" not in records(tmp_path)[0] and "tokens_per_s" in records(tmp_path)[0]


@pytest.mark.parametrize(
    "name, precision, want",
    [("NVIDIA H100 80GB HBM3", "bf16", 989.0), ("NVIDIA H100 PCIe", "bf16", 756.0),
     ("NVIDIA H100 PCIe", "fp8", 1513.0), ("NVIDIA H200", "fp8", 1979.0), ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
     ("NVIDIA GeForce RTX 4090", "bf16", None)],
)  # fmt: skip
def test_peak_lookup_by_device_name(monkeypatch, name: str, precision: str, want: float | None) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops(torch.device("cuda", 0), precision) == want
