"""Saves in the background (ckpt/async_save.py, ckpt/staging.py, trainer/checkpointing/saver.py): the same bytes
as a synchronous save, the same commit protocol, failures reported once and stopping the run, nothing half
committed. The process-level cases (kill -9 mid-write, SIGTERM, the CLI's one line) are in
test_ckpt_async_process.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_fixtures import make_meta, mixed_tensors
from typer.testing import CliRunner

from ckpt import list_committed, save_checkpoint, verify_checkpoint
from ckpt.async_save import AsyncCheckpointer, SaveOutcome
from ckpt.faults import SLOW_S
from dist_helpers import run_distributed
from moectl.cli.app import app
from moectl.core.config.load import load_config
from moectl.core.errors import CheckpointError
from trainer.checkpointing.save import save_training_checkpoint
from trainer.checkpointing.saver import BACKGROUND, RunCheckpointer
from trainer.loop import Trainer
from trainer.observer import SilentObserver

FAST = [
    "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=16", "moe.num_experts=4", "moe.ffn_hidden_size=16", "train.micro_batch_size=2",
    "train.global_batch_size=8", "data.source=synthetic", "train.eval_interval=null", "optimizer.lr_warmup_iters=0",
]  # fmt: skip


def _files(step_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(step_dir.iterdir())}


def _files_of(step: int) -> dict[str, dict[str, torch.Tensor]]:
    return {"model-00000.safetensors": mixed_tensors(step),
            "optim-00000.safetensors": {"w.exp_avg": torch.full((64, 8), float(step))}}  # fmt: skip


def test_a_background_save_writes_what_was_staged_while_the_source_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _files_of(1)
    saver = AsyncCheckpointer()
    monkeypatch.setenv("MOECTL_CKPT_FAIL", "0:write:slow")  # the writer is still writing when training goes on
    saver.start(tmp_path / "a", 1, files, make_meta(), keep_last=None, blocking_since=time.perf_counter())
    assert saver.in_flight and saver.poll() is None
    for t in files["optim-00000.safetensors"].values():
        t.add_(1)  # the next optimizer step, in place
    with pytest.raises(RuntimeError, match="still in flight"):
        saver.start(tmp_path / "a", 2, files, make_meta(), keep_last=None, blocking_since=time.perf_counter())
    outcome = saver.wait()
    assert outcome is not None and outcome.ok and outcome.path == tmp_path / "a" / "step_00000001"
    assert outcome.background_s >= SLOW_S > outcome.blocking_s and not saver.in_flight
    monkeypatch.delenv("MOECTL_CKPT_FAIL")
    save_checkpoint(tmp_path / "s", 1, _files_of(1), make_meta())
    assert _files(tmp_path / "a" / "step_00000001") == _files(tmp_path / "s" / "step_00000001")  # byte for byte
    # The buffers are reused by the next save (pinning them again would cost seconds on CUDA).
    assert saver.staging.new_bytes(_files_of(2)) == 0
    before = saver.staging._arena.buffer.data_ptr()  # type: ignore[union-attr]
    saver.start(tmp_path / "a", 2, _files_of(2), make_meta(), keep_last=1, blocking_since=time.perf_counter())
    assert saver.wait().ok  # type: ignore[union-attr]
    assert saver.staging._arena.buffer.data_ptr() == before  # type: ignore[union-attr]
    assert list_committed(tmp_path / "a") == [tmp_path / "a" / "step_00000002"]  # keep_last applied by the commit


def test_a_failed_background_save_is_kept_until_collected_and_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(tmp_path, 1, _files_of(1), make_meta())
    saver = AsyncCheckpointer()
    monkeypatch.setenv("MOECTL_CKPT_FAIL", "0:write:enospc")
    saver.start(tmp_path, 2, _files_of(2), make_meta(), keep_last=None, blocking_since=time.perf_counter())
    deadline = time.monotonic() + 30
    while not saver.failed():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert saver.poll(committed_only=True) is None and saver.in_flight  # left for the agreed moment
    outcome = saver.wait()
    assert outcome is not None and not outcome.ok and "No space left on device" in str(outcome.error)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]  # the partial folder is gone


def _trainer(run_dir: Path, *extra: str) -> Trainer:
    return Trainer(load_config(None, [*FAST, f"run_dir={run_dir}", *extra]), SilentObserver())


def test_a_runs_background_save_equals_its_synchronous_save_byte_for_byte(tmp_path: Path) -> None:
    t = _trainer(tmp_path / "run", "train.train_iters=2")
    t.run()
    # The same state saved both ways: every file, the manifest included, is identical. No field may differ:
    # the manifest holds no time or nonce, and the RNG state and probe are taken on the training thread.
    bg = RunCheckpointer(t.cfg, t.engine, t.rt.pstate, tmp_path / "bg")
    assert bg.save(2, t.probe_loss) == []  # in flight: reported once committed
    report = bg.finish()
    assert report is not None and report.mode == BACKGROUND and report.path == tmp_path / "bg" / "step_00000002"
    save_training_checkpoint(tmp_path / "sync", 2, t.cfg, t.engine, t.rt.pstate, t.probe_loss())
    assert _files(report.path) == _files(tmp_path / "sync" / "step_00000002")
    assert (tmp_path / "bg" / "latest").read_text() == "step_00000002\n"


@pytest.mark.parametrize("how, words", [("enospc", "No space left on device"), ("eacces", "Permission denied")])
def test_a_failing_writer_stops_the_run_with_one_line_and_commits_nothing(
    tmp_path: Path, how: str, words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOECTL_CKPT_FAIL", f"0:write:{how}@4")
    t = _trainer(tmp_path, "train.train_iters=12", "checkpoint.save_interval=2")
    with pytest.raises(CheckpointError) as err:
        t.run()
    line = err.value.one_line()
    assert "\n" not in line and line.startswith("background save of checkpoint step 4 failed: saving checkpoint ")
    assert words in line and "latest still names step_00000002" in line
    assert f"--set checkpoint.load={tmp_path / 'checkpoints'}" in line
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]  # no step 4, no partial folder
    assert verify_checkpoint(root / "step_00000002") == []
    records = [r for r in _records(tmp_path)]
    trained = [r["step"] for r in records if "loss" in r]
    assert 5 <= trained[-1] <= 6  # reported after a step, at the latest by the next save, which then never starts
    assert [r["checkpoint"] for r in records if "checkpoint" in r] == ["step_00000002"]


def test_a_failing_synchronous_save_names_what_latest_still_names_and_how_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user trial filled the disk under a run with `checkpoint.async_save=false`: its one line ended "fix: nothing
    was committed and latest is unchanged; fix the named rank's error and save again" (the save's words, which a
    training user cannot act on), where the same failure in the background says what `latest` still names and the
    command to resume. Both say so now."""
    monkeypatch.setenv("MOECTL_CKPT_FAIL", "0:write:enospc@4")
    t = _trainer(tmp_path, "train.train_iters=12", "checkpoint.save_interval=2", "checkpoint.async_save=false")
    with pytest.raises(CheckpointError) as err:
        t.run()
    line = err.value.one_line()
    assert "\n" not in line and line.startswith("save of checkpoint step 4 failed: saving checkpoint ")
    assert "No space left on device" in line and "latest still names step_00000002" in line
    assert f"--set checkpoint.load={tmp_path / 'checkpoints'}" in line and "save again" not in line
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000002"]
    assert [r["step"] for r in _records(tmp_path) if "loss" in r] == [1, 2, 3, 4]  # stopped at the failed save


def test_a_save_that_committed_before_its_outcome_was_lost_is_the_one_to_resume_from(tmp_path: Path) -> None:
    """Rank 0 killed after committing step 4, before broadcasting the outcome: the survivor's next save (or the
    end of the run) collects a failed outcome (the lost peer), raises it, and then `abandon` has nothing in
    flight to look at. The failed run's line named step 2, the previous commit; it names the disk's step 4."""
    t = _trainer(tmp_path / "run", "train.train_iters=2")
    t.run()
    root = tmp_path / "ck"
    saver = RunCheckpointer(t.cfg, t.engine, t.rt.pstate, root)
    saver.save(2, t.probe_loss)
    assert saver.finish() is not None and saver.last_committed == root / "step_00000002"
    save_training_checkpoint(root, 4, t.cfg, t.engine, t.rt.pstate, t.probe_loss())  # rank 0's commit of step 4

    class LostPeer:  # the writer of a save whose outcome's broadcast failed: a peer died after the commit
        def __init__(self) -> None:
            self.outcome: SaveOutcome | None = SaveOutcome(4, None, RuntimeError("Connection closed by peer"),
                                                           0.0, 0.0, 0)  # fmt: skip

        def wait(self) -> SaveOutcome | None:
            outcome, self.outcome = self.outcome, None
            return outcome

        def poll(self, committed_only: bool = False) -> None:
            return None

        def close(self) -> None:
            pass

    saver._writer.close()
    saver._writer = LostPeer()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        saver.finish()
    saver.abandon()
    assert saver.committed() == root / "step_00000004"


def test_an_abort_names_the_step_whose_commit_was_cut_before_latest_moved(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: a second Ctrl-C (or a kill) between a save's rename and the move of `latest` leaves a pending
    `latest` naming the new step, which a resume loads; the abort line named the step before it. `committed`
    now takes what the disk says a resume would load."""
    from ckpt.faults import InjectedCrash

    t = _trainer(tmp_path / "run", "train.train_iters=2")
    t.run()
    root = tmp_path / "ck"
    saver = RunCheckpointer(t.cfg, t.engine, t.rt.pstate, root)
    saver.save(2, t.probe_loss)
    assert saver.finish() is not None and saver.committed() == root / "step_00000002"
    monkeypatch.setenv("MOECTL_CKPT_FAIL", "0:before_latest:crash")
    with pytest.raises(InjectedCrash):
        save_training_checkpoint(root, 4, t.cfg, t.engine, t.rt.pstate, t.probe_loss())
    assert (root / "latest").read_text().strip() == "step_00000002"  # the cut commit's state
    assert saver.committed() == root / "step_00000004"


def _records(run_dir: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_cli_prints_the_failure_as_one_line_and_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOECTL_CKPT_FAIL", "0:finalize:enospc@2")
    sets = [a for s in [*FAST, "train.train_iters=4", "checkpoint.save_interval=2"] for a in ("--set", s)]
    res = CliRunner().invoke(app, ["train", "configs/tiny.yaml", *sets, "--run-dir", str(tmp_path)])
    assert res.exit_code == 1, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.output, res.output
    assert errors[0].startswith("error: background save of checkpoint step 2 failed") and "No space left" in errors[0]
    assert "no checkpoint of this run was committed" in errors[0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == []


def _two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import os

    out: dict[str, Any] = {}
    t = _trainer(Path(root) / "run", "train.train_iters=2")
    t.run()
    bg = RunCheckpointer(t.cfg, t.engine, t.rt.pstate, Path(root) / "bg")
    bg.save(2, t.probe_loss)  # the vote runs on the writer's own gloo group, from its thread
    out["bg"] = str(bg.finish().path)  # type: ignore[union-attr]
    save_training_checkpoint(Path(root) / "sync", 2, t.cfg, t.engine, t.rt.pstate, t.probe_loss())
    # A writer that fails on rank 1 only: both ranks stop after the same step with the same error.
    os.environ["MOECTL_CKPT_FAIL"] = "1:write:eacces@4"
    t = _trainer(Path(root) / "fail", "train.train_iters=12", "checkpoint.save_interval=2")
    try:
        t.run()
    except CheckpointError as e:
        out["error"] = e.one_line()
    out["trained"] = [r["step"] for r in _records(Path(root) / "fail") if "loss" in r][-1] if rank == 0 else None
    out["stopped_after"] = t.last_record["step"]  # type: ignore[index]
    return out


@pytest.mark.slow
def test_two_ranks_background_equals_sync_and_a_failure_on_one_rank_stops_both(tmp_path: Path) -> None:
    r0, r1 = run_distributed(_two_ranks, world_size=2, timeout=120, root=str(tmp_path))
    assert r0["bg"] == r1["bg"] == str(tmp_path / "bg" / "step_00000002")
    a, b = _files(tmp_path / "bg" / "step_00000002"), _files(tmp_path / "sync" / "step_00000002")
    assert {"manifest.json", "optim-00000.safetensors", "optim-00001.safetensors"} <= set(a) and a == b
    assert r0["error"] == r1["error"] and "failed on rank 1: PermissionError" in r0["error"]
    assert r0["stopped_after"] == r1["stopped_after"] == r0["trained"]
    root = tmp_path / "fail" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]


class _OutcomeLost:
    """A writer whose save failed where only the outcome broadcast can fail: after rank 0 moved `latest`."""

    def wait(self) -> SaveOutcome:
        return SaveOutcome(6, None, RuntimeError("peer lost in the outcome broadcast"), 0.0, 0.0, 0)


def test_a_failed_run_names_a_save_that_committed_before_its_outcome_was_lost(tmp_path: Path) -> None:
    """Rank 0 moves `latest` before it broadcasts the outcome; a peer killed in between fails only the
    broadcast. The run's error must then name what a resume would load (the newer step), not the one
    before; and a `latest` older than what the run knows it committed never replaces it."""
    t = _trainer(tmp_path / "run")
    root = tmp_path / "ck"
    for step in (3, 6):
        save_checkpoint(root, step, _files_of(step), make_meta())
    ck = RunCheckpointer(t.cfg, t.engine, t.rt.pstate, root)
    ck.last_committed = root / "step_00000003"
    ck._writer = _OutcomeLost()  # type: ignore[assignment]
    ck.abandon()
    assert ck.last_committed == root / "step_00000006"

    ck.last_committed = root / "step_00000009"  # committed by this run, though `latest` still says 6
    ck._writer = _OutcomeLost()  # type: ignore[assignment]
    ck.abandon()
    assert ck.last_committed == root / "step_00000009"
