"""A run that saves in the background takes its staging buffer at start-up (trainer/checkpointing/saver.py
`RunCheckpointer.reserve`, ckpt/staging.py `reserve_for`): sized exactly as the first save needs, so that save
only copies; reported once (a log line and a metrics record); not taken when no save will happen."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ckpt.staging import staged_size
from moectl.core.config.load import load_config
from trainer.checkpointing.save import checkpoint_parts
from trainer.checkpointing.saver import BACKGROUND, RunCheckpointer
from trainer.loop import Trainer
from trainer.observer import SilentObserver

FAST = [
    "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=16", "moe.num_experts=4", "moe.ffn_hidden_size=16", "train.micro_batch_size=2",
    "train.global_batch_size=8", "data.source=synthetic", "train.eval_interval=null", "optimizer.lr_warmup_iters=0",
]  # fmt: skip


def _trainer(run_dir: Path, *extra: str) -> Trainer:
    return Trainer(load_config(None, [*FAST, f"run_dir={run_dir}", *extra]), SilentObserver())


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


class _Lines(SilentObserver):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, line: str) -> None:
        self.lines.append(line)


def test_the_reservation_is_exactly_what_the_first_save_stages_and_is_reused(tmp_path: Path) -> None:
    for optimizer in ("adam", "muon"):  # moments differ: the sizing must follow the optimizer's state
        t = _trainer(tmp_path / optimizer, f"optimizer.optimizer={optimizer}")
        saver = RunCheckpointer(t.cfg, t.engine, t.rt.pstate, tmp_path / optimizer / "ck")
        reserved = saver.reserve(0)  # before any step, as a run does at start-up
        assert reserved is not None and not reserved.why_not and reserved.how == "pageable"
        writer = saver._writer
        assert writer is not None
        arena = writer.staging._arena
        t.train_step(0)
        files, _ = checkpoint_parts(1, t.cfg, t.engine, t.rt.pstate, 0.0)
        assert reserved.nbytes == writer.staging.nbytes == staged_size(files)
        assert writer.staging.new_bytes(files) == 0  # the first save allocates nothing
        assert saver.save(1, t.probe_loss) == []
        report = saver.finish()
        assert report is not None and report.mode == BACKGROUND
        assert writer.staging._arena is arena  # the same buffer: not grown, not replaced
        saver.close()


def test_a_saving_run_reports_its_reservation_once_and_a_run_without_saves_reserves_nothing(tmp_path: Path) -> None:
    seen = _Lines()
    t = Trainer(load_config(None, [*FAST, f"run_dir={tmp_path / 'a'}", "train.train_iters=2",
                                   "checkpoint.save_interval=2"]), seen)  # fmt: skip
    t.run()
    reserve_lines = [x for x in seen.lines if "reserved" in x]
    assert len(reserve_lines) == 1 and "at start-up" in reserve_lines[0]
    reserve = [r for r in _records(tmp_path / "a") if "save_reserve_s" in r]
    assert len(reserve) == 1 and reserve[0]["step"] == 0 and reserve[0]["save_reserve_bytes"] > 0
    saves = [r for r in _records(tmp_path / "a") if "checkpoint" in r]
    assert [r["save_mode"] for r in saves] == ["background"] and set(saves[0]["save_phases"]) >= {"write_s", "fsync_s"}

    for extra in (["checkpoint.save_interval=null"], ["checkpoint.save_interval=2", "checkpoint.async_save=false"]):
        quiet = _Lines()
        t = Trainer(load_config(None, [*FAST, f"run_dir={tmp_path / 'b'}", "train.train_iters=2", *extra]), quiet)
        t.run(overwrite=True)
        assert not [x for x in quiet.lines if "reserved" in x]
        assert not [r for r in _records(tmp_path / "b") if "save_reserve_s" in r]
        assert t.checkpointer._writer is None  # no buffer, no commit group


def test_no_reservation_where_host_memory_is_short_and_the_line_says_why(tmp_path: Path, monkeypatch: Any) -> None:
    from ckpt import host_copy

    monkeypatch.setattr(host_copy, "host_memory_available", lambda: 1 << 20)
    t = _trainer(tmp_path)
    saver = RunCheckpointer(t.cfg, t.engine, t.rt.pstate, tmp_path / "ck")
    reserved = saver.reserve(0)
    assert reserved is not None and reserved.nbytes == 0 and "GiB is available" in reserved.why_not
    assert "no host buffers reserved" in reserved.line() and saver._writer is not None
    assert saver._writer.staging.nbytes == 0
