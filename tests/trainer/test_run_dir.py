"""run_dir hygiene through the real loop (trainer/run_dir.py): no silent overwrite, metrics cut back on resume,
interrupted saves removed (only ours), one run per run_dir, and stops on a signal that save or warn."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
from pathlib import Path
from typing import Any

import pytest

from ckpt import list_committed, verify_checkpoint
from moectl.core.config.load import load_config
from moectl.core.errors import MoectlError, UsageError
from trainer.loop import Trainer
from trainer.metrics import MetricsWriter
from trainer.observer import SilentObserver
from trainer.run_dir import RunDirLock, create_run_dir
from trainer.stop import StopSignals

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = [
    "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=16", "moe.num_experts=4", "moe.ffn_hidden_size=16", "train.micro_batch_size=2",
    "train.global_batch_size=4", "data.source=synthetic", "train.eval_interval=null", "optimizer.lr_warmup_iters=0",
]


def trainer(run_dir: Path, *extra: str) -> Trainer:
    return Trainer(load_config(None, [*FAST, f"run_dir={run_dir}", *extra]), SilentObserver())


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_fresh_run_refuses_another_runs_metrics_unless_overwrite(tmp_path: Path) -> None:
    trainer(tmp_path, "train.train_iters=2", "checkpoint.save_interval=2").run()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(UsageError) as e:
        trainer(tmp_path, "train.train_iters=3", "optimizer.lr=1e-4").run()
    # a saving run writes more records than its steps (its save records), so only the span's end is fixed
    assert "holds another run's metrics.jsonl (" in e.value.message and "-2); a fresh run" in e.value.message
    assert "--overwrite" in e.value.fix and f"checkpoint.load={tmp_path / 'checkpoints'}" in e.value.fix
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before  # nothing touched
    trainer(tmp_path, "train.train_iters=3", "optimizer.lr=1e-4").run(overwrite=True)
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]
    assert "lr: 0.0001" in (tmp_path / "config.yaml").read_text()


def test_resuming_is_advised_only_where_there_is_a_checkpoint(tmp_path: Path) -> None:
    """A user trial: junk in metrics.jsonl of an otherwise empty run_dir got "resume that run with --set
    checkpoint.load=<run_dir>/checkpoints", a folder that did not exist."""
    (tmp_path / "metrics.jsonl").write_text("junk\n")
    with pytest.raises(UsageError) as e:
        trainer(tmp_path, "train.train_iters=2").run()
    assert "(0 records, unreadable records)" in e.value.message
    assert "checkpoint.load" not in e.value.fix and e.value.fix.startswith("train into another --run-dir")


def test_a_resume_cuts_metrics_back_to_its_step_before_appending(tmp_path: Path) -> None:
    # A run that saved at step 3 and died after step 5: metrics hold 1-5 (evals at 2, 4), the checkpoint is 3.
    trainer(tmp_path, "train.train_iters=5", "checkpoint.save_interval=3", "train.eval_interval=2",
            "train.eval_iters=1").run()  # fmt: skip
    root = tmp_path / "checkpoints"
    shutil.rmtree(root / "step_00000005")
    (root / "latest").write_text("step_00000003\n")
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 1.')  # and the crash tore its last record
    t = trainer(tmp_path, "train.train_iters=6", "train.eval_interval=2", "train.eval_iters=1",
                f"checkpoint.load={root}", "checkpoint.save_interval=3")  # fmt: skip
    t.run()
    recs = records(tmp_path)
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in recs if "eval_loss" in r] == [2, 4, 6]


def test_interrupted_saves_are_removed_at_start_and_only_ours(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    ours = root / "step_00000007.tmp-0123abcd"
    ours.mkdir(parents=True)
    (ours / "model-00000.safetensors").write_bytes(b"half a shard")
    (ours / "manifest.json").write_text("{")
    trash = root / "step_00000001.trash-00ff"
    trash.mkdir()
    (trash / "optim-00001.safetensors").write_bytes(b"x")
    foreign = root / "step_00000008.tmp-feed"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")  # no save writes this: never deleted
    lookalike = root / "step_00000009.tmp-zz"  # not a nonce moectl writes (hex only)
    lookalike.mkdir()
    logged: list[str] = []
    observer = SilentObserver()
    observer.log = logged.append  # type: ignore[method-assign]
    Trainer(load_config(None, [*FAST, f"run_dir={tmp_path}", "train.train_iters=1"]), observer).run()
    assert not ours.exists() and not trash.exists()
    assert (foreign / "notes.txt").read_text() == "mine" and lookalike.is_dir()
    assert any("removed step_00000007.tmp-0123abcd" in line for line in logged), logged
    assert any(f"left {foreign} alone" in line and "notes.txt" in line for line in logged), logged


def test_a_second_run_into_a_run_dir_in_use_is_refused(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    held = RunDirLock(tmp_path)
    try:
        with pytest.raises(UsageError, match=rf"run_dir {tmp_path} is in use by another moectl train "
                                             rf"\(pid {os.getpid()}\)") as e:  # fmt: skip
            trainer(tmp_path, "train.train_iters=1").run()
        assert e.value.exit_code == 2  # nothing was trained: usage, as every other refusal at start (a user trial)
    finally:
        held.release()
    trainer(tmp_path, "train.train_iters=1").run()  # released: the next run goes ahead


class _FullDisk:
    """A file whose every flush fails as on a full filesystem (ENOSPC)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self) -> None:
        self.real.close()
        self.flush()  # as a buffered file does: the rest cannot be written either


def test_a_full_disk_at_the_lock_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = open

    def full_open(path: Any, *a: Any, **kw: Any) -> Any:
        f = real_open(path, *a, **kw)
        return _FullDisk(f) if str(path).endswith(".moectl.lock") else f

    monkeypatch.setattr("builtins.open", full_open)
    with pytest.raises(UsageError, match=r"cannot write \.moectl\.lock \(No space left on device\)") as e:
        RunDirLock(tmp_path)
    assert "free space" in e.value.fix


def test_a_full_disk_mid_run_stops_it_with_one_line_about_its_metrics(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path)
    writer.write({"step": 1, "loss": 2.0})
    writer._file = _FullDisk(writer._file)  # the filesystem fills up
    writer._file.real.write('{"step": 2, "lo')  # the part of the next record that still fit
    writer._file.real.flush()
    with pytest.raises(MoectlError, match=r"metrics\.jsonl: cannot write the run's metrics \(No space left"):
        writer.write({"step": 2, "loss": 1.9})
    writer.close()  # nothing left to flush: no second error
    writer.write({"step": 3, "loss": 1.8})  # the loop's last record after the error: nowhere to go, no raise
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'  # no half record left


@pytest.mark.parametrize("make", ["file", "parent_file", "metrics_folder"])
def test_a_run_dir_that_cannot_be_used_is_one_line(tmp_path: Path, make: str) -> None:
    target = tmp_path / "run"
    if make == "file":
        target.write_text("in the way")
        words = "a file is in the way"
    elif make == "parent_file":
        (tmp_path / "f").write_text("x")
        target = tmp_path / "f" / "run"
        words = f"{tmp_path / 'f'} is a file, not a folder"
    else:
        (target / "metrics.jsonl").mkdir(parents=True)
        words = "metrics.jsonl is a folder"
    with pytest.raises(UsageError) as e:
        trainer(target, "train.train_iters=1").run()
    assert words in e.value.one_line() and "\n" not in e.value.one_line()


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not Path("/dev/null").exists(), reason="POSIX special files")
@pytest.mark.parametrize("kind", ["devnull", "fifo", "socket", "devnull_parent"])
def test_a_run_dir_that_is_a_device_fifo_or_socket_is_never_to_be_removed(tmp_path: Path, kind: str) -> None:
    """A user trial: `--run-dir /dev/null` said "remove that file". Such a path is named for what it is, and the
    fix is another --run-dir; only a regular file in the way keeps "remove that file"."""
    fix = "choose another --run-dir (or set run_dir in the config)"
    if kind == "devnull":
        target, what = Path("/dev/null"), "a character device"
    elif kind == "fifo":
        target, what = tmp_path / "fifo", "a named pipe (FIFO)"
        os.mkfifo(target)
    elif kind == "socket":
        target, what = tmp_path / "sock", "a socket"
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(target))
        sock.close()  # the name stays
    else:
        target = Path("/dev/null/run")
    with pytest.raises(UsageError) as e:
        create_run_dir(target)
    if kind == "devnull_parent":
        assert e.value.one_line() == (f"run_dir {target} cannot be created: /dev/null is a character device, not a "
                                      f"folder. fix: {fix}")  # fmt: skip
    else:
        assert e.value.one_line() == f"run_dir {target} exists and is not a directory: it is {what}. fix: {fix}"
    assert "remove" not in e.value.one_line()


def _signal_at(t: Trainer, step: int, sig: int) -> None:
    real = t.train_step

    def step_then_signal(s: int) -> dict:
        out = real(s)
        if s + 1 == step:
            os.kill(os.getpid(), sig)
        return out

    t.train_step = step_then_signal  # type: ignore[method-assign]


@pytest.mark.parametrize("save", [True, False])
def test_sigterm_stops_after_the_step_and_saves_or_warns(tmp_path: Path, save: bool) -> None:
    extra = ["checkpoint.save_interval=100"] if save else []
    t = trainer(tmp_path, "train.train_iters=10", *extra)
    logged: list[str] = []
    t.observer.log = logged.append  # type: ignore[method-assign]
    _signal_at(t, 3, signal.SIGTERM)
    with StopSignals() as stop:
        result = t.run(stop=stop)
    assert result.steps == 3 and result.stopped_by == "SIGTERM" and result.stop_signum == signal.SIGTERM
    assert [r["step"] for r in records(tmp_path) if "loss" in r] == [1, 2, 3]
    if save:
        assert result.saved == tmp_path / "checkpoints" / "step_00000003"
        (saved,) = [r for r in records(tmp_path) if "checkpoint" in r]  # the save's record, once it committed
        assert saved["step"] == 3 and saved["checkpoint"] == "step_00000003" and saved["save_mode"] == "background"
        assert [p.name for p in list_committed(tmp_path / "checkpoints")] == ["step_00000003"]
        assert verify_checkpoint(result.saved) == []
        assert any("stopped cleanly after step 3" in line for line in logged)
        assert "SIGTERM: stopping after step 3; saving a checkpoint first" in logged  # said before the save
        assert logged.index("SIGTERM: stopping after step 3; saving a checkpoint first") < len(logged) - 1
    else:
        assert "SIGTERM: stopping after step 3" in logged
        assert result.saved is None and not (tmp_path / "checkpoints").exists()
        assert any(line.startswith("warning: SIGTERM: stopped after step 3 with nothing saved") for line in logged)


def test_a_signal_during_the_last_step_lets_the_run_finish(tmp_path: Path) -> None:
    t = trainer(tmp_path, "train.train_iters=2")
    _signal_at(t, 2, signal.SIGTERM)
    with StopSignals() as stop:
        result = t.run(stop=stop)
    assert result.steps == 2 and result.stopped_by is None


def test_a_saving_resume_from_an_older_step_is_refused_while_later_checkpoints_exist(tmp_path: Path) -> None:
    """Resuming from step 2 where steps 4 and 6 are saved, with saves on, used to cut metrics back to step 2
    (dropping the records of steps 3-6), train, then fail when its save reached step_00000004. Now it is refused
    first; without saves it replays from step 2 as any resume does."""
    trainer(tmp_path, "train.train_iters=6", "checkpoint.save_interval=2").run()
    root = tmp_path / "checkpoints"
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(UsageError) as e:
        trainer(tmp_path, "train.train_iters=6", "checkpoint.save_interval=2",
                f"checkpoint.load={root / 'step_00000002'}").run()  # fmt: skip
    assert "2 checkpoint(s) after step 2 (step_00000004..step_00000006): a resume from step 2 that saves" in (
        e.value.message)
    assert f"checkpoint.load={root / 'step_00000006'}" in e.value.fix and "another --run-dir" in e.value.fix
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != ".moectl.lock"} == {
        k: v for k, v in before.items() if k != ".moectl.lock"}
    assert [p.name for p in list_committed(root)] == ["step_00000002", "step_00000004", "step_00000006"]
    # into another run_dir it resumes (the checkpoints stay where they are); from the latest, here too
    branch = trainer(tmp_path / "branch", "train.train_iters=4", f"checkpoint.load={root / 'step_00000002'}")
    assert branch.run().steps == 4
    assert trainer(tmp_path, "train.train_iters=7", f"checkpoint.load={root}").run().steps == 7
    replay = trainer(tmp_path, "train.train_iters=3", f"checkpoint.load={root / 'step_00000002'}")  # saves nothing
    assert replay.run().steps == 3 and [r["step"] for r in records(tmp_path) if "loss" in r] == [1, 2, 3]



def test_a_run_killed_between_a_commit_and_latest_resumes_from_that_step(tmp_path: Path) -> None:
    """A user trial: kill -9 of a worker right after step 4's folder was renamed, before `latest` moved, left
    `latest` on step 2 and `latest.tmp-<nonce>` naming step 4. Resuming with the same command was refused
    ("holds 1 checkpoint(s) after step 2"), so an unattended job could not go on. It now resumes from step 4,
    moves `latest` there, and metrics.jsonl keeps one record per step."""
    trainer(tmp_path, "train.train_iters=4", "checkpoint.save_interval=2", "checkpoint.async_save=false").run()
    root = tmp_path / "checkpoints"
    (root / "latest").write_text("step_00000002\n")
    (root / "latest.tmp-3f2a9c01").write_text("step_00000004\n")
    t = trainer(tmp_path, "train.train_iters=6", "checkpoint.save_interval=2", f"checkpoint.load={root}")
    assert t.start_step == 4
    assert t.run().steps == 6
    assert (root / "latest").read_text() == "step_00000006\n" and not list(root.glob("latest.tmp-*"))
    assert [r["step"] for r in records(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_when_the_newest_later_checkpoint_is_damaged_the_fix_does_not_send_the_user_to_it(tmp_path: Path) -> None:
    """A user trial truncated the newest checkpoint, was refused loading it, went back a step, and was told to
    "resume from the newest", the damaged one. A glance (manifest, file sizes; no hashing) now names the damage
    and the fix is to move the later steps aside."""
    trainer(tmp_path, "train.train_iters=4", "checkpoint.save_interval=2").run()
    root = tmp_path / "checkpoints"
    shard = sorted((root / "step_00000004").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(UsageError) as e:
        trainer(tmp_path, "train.train_iters=6", "checkpoint.save_interval=2",
                f"checkpoint.load={root / 'step_00000002'}").run()  # fmt: skip
    assert f"the newest, step_00000004, is damaged ({shard.name} is" in e.value.message
    assert "checkpoint.load" not in e.value.fix and f"move step_00000004 out of {root}" in e.value.fix


def test_a_resume_with_nothing_to_train_leaves_config_yaml_as_it_was(tmp_path: Path) -> None:
    """train_iters at or below the checkpoint's step trains nothing and exits 0; it used to rewrite
    run_dir/config.yaml with its own train_iters, so the record no longer said how the run was trained."""
    trainer(tmp_path, "train.train_iters=4", "checkpoint.save_interval=2").run()
    before = (tmp_path / "config.yaml").read_bytes()
    result = trainer(tmp_path, "train.train_iters=3", f"checkpoint.load={tmp_path / 'checkpoints'}").run()
    assert result.steps == 4 and (tmp_path / "config.yaml").read_bytes() == before
    # into a new run_dir there is no record to keep: it gets one
    trainer(tmp_path / "new", "train.train_iters=3", f"checkpoint.load={tmp_path / 'checkpoints'}").run()
    assert (tmp_path / "new" / "config.yaml").is_file()

def test_a_step_0_checkpoint_counts_as_a_resume_and_nothing_to_train_is_not_refused(tmp_path: Path) -> None:
    """A loaded step-0 checkpoint (`ckpt import-hf` writes one) that saves into a run_dir holding steps 2 and 4 is
    refused like any older step; a resume with nothing left to train saves nothing and is not."""
    first = trainer(tmp_path, "train.train_iters=4", "checkpoint.save_interval=2")
    first.save(0)
    first.run()
    root = tmp_path / "checkpoints"
    assert [p.name for p in list_committed(root)] == ["step_00000000", "step_00000002", "step_00000004"]
    with pytest.raises(UsageError, match="2 checkpoint\\(s\\) after step 0"):
        trainer(tmp_path, "train.train_iters=4", "checkpoint.save_interval=2",
                f"checkpoint.load={root / 'step_00000000'}").run(overwrite=True)  # fmt: skip
    done = trainer(tmp_path, "train.train_iters=2", "checkpoint.save_interval=2", f"checkpoint.load={root / 'step_00000002'}")
    assert done.run().steps == 2


@pytest.mark.parametrize("make", ["file", "latest-folder", "read-only"])
def test_a_checkpoints_folder_the_run_could_not_save_into_is_refused_before_the_first_step(
        tmp_path: Path, make: str) -> None:
    """A user trial: with run_dir/checkpoints a file, its `latest` a folder, or the folder read-only, the run
    trained up to its first save and only then failed (exit 1, nothing committed): every step before it lost."""
    root = tmp_path / "checkpoints"
    if make == "file":
        root.write_text("notes\n")
    else:
        (root / "latest").mkdir(parents=True)
        if make == "read-only":
            (root / "latest").rmdir()
            root.chmod(0o500)
            if os.access(root, os.W_OK):  # root ignores the mode: nothing to refuse
                root.chmod(0o700)
                pytest.skip("this user writes into any folder (root)")
    try:
        with pytest.raises(UsageError) as e:
            trainer(tmp_path, "train.train_iters=4", "checkpoint.save_interval=2").run()
    finally:
        if root.is_dir():
            root.chmod(0o700)
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before the first step
    what = {"file": f"{root} is a file, not a folder", "read-only": f"{root} is not writable by this user",
            "latest-folder": f"{root / 'latest'} is a folder, not the file a save rewrites"}[make]
    assert what in e.value.message and "could not" in e.value.message, e.value.message
    trainer(tmp_path, "train.train_iters=2").run()  # a run that saves nothing is not refused


def test_a_broken_latest_link_is_no_reason_to_refuse_a_saving_run(tmp_path: Path) -> None:
    """A review: a dangling `latest` symlink was refused at start-up, though the save's os.replace puts a file
    over it (and discovery takes it as absent)."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").symlink_to(tmp_path / "nowhere")
    trainer(tmp_path, "train.train_iters=2", "checkpoint.save_interval=2").run()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert not (tmp_path / "checkpoints" / "latest").is_symlink()
