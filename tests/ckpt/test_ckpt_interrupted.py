"""Acceptance test 3 (storage half): an interrupted save keeps the previous checkpoint; discovery and load paths.

A crash is simulated with `MOECTL_CKPT_FAIL=0:<phase>:crash`, which skips all cleanup, as a killed process
would. (The multi-rank variant of a clean failure is in test_ckpt_multirank.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_fixtures import make_meta, mixed_tensors, save_simple

from ckpt import (
    CheckpointSaveError,
    find_latest,
    list_committed,
    list_uncommitted,
    open_checkpoint,
    resolve_load_path,
    save_checkpoint,
    verify_checkpoint,
)
from ckpt import problems as P
from ckpt.faults import InjectedCrash
from moectl.core.errors import CheckpointArgumentError, CheckpointError

THREE_FILES = {
    "model-00000.safetensors": {"a": torch.ones(3)},
    "model-00001.safetensors": {"b": torch.ones(3)},
    "optim-00000.safetensors": {"a.exp_avg": torch.ones(3)},
}


@pytest.mark.parametrize("phase, files_left", [("write", 1), ("before_manifest", 3)])
def test_crash_mid_save_keeps_latest_on_the_previous_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str, files_left: int
) -> None:
    root = tmp_path / "checkpoints"
    save_simple(root, 5, seed=5)
    monkeypatch.setenv("MOECTL_CKPT_FAIL", f"0:{phase}:crash")
    with pytest.raises(InjectedCrash):
        save_checkpoint(root, 10, THREE_FILES, make_meta())
    monkeypatch.delenv("MOECTL_CKPT_FAIL")

    (partial,) = [p for p in root.iterdir() if p.name.startswith("step_00000010")]
    assert partial.name.startswith("step_00000010.tmp-")
    assert sorted(p.name for p in partial.iterdir()) == sorted(THREE_FILES)[:files_left]  # no manifest.json
    assert (root / "latest").read_text() == "step_00000005\n"
    assert list_committed(root) == [root / "step_00000005"]
    assert list_uncommitted(root) == [partial]
    assert find_latest(root) == resolve_load_path(root) == root / "step_00000005"
    problems = verify_checkpoint(partial)
    assert {p.kind for p in problems} == {P.INCOMPLETE} and any(p.file == "manifest.json" for p in problems)
    with pytest.raises(CheckpointError, match="interrupted save"):
        open_checkpoint(partial)
    # Resume works: the previous step loads, and the next save of step 10 succeeds beside the debris.
    with open_checkpoint(root) as ck:
        assert ck.step == 5 and torch.equal(ck.read("flags"), mixed_tensors(5)["flags"])
    save_simple(root, 10, seed=10)
    assert find_latest(root) == root / "step_00000010" and partial.exists()


def test_a_kill_between_the_rename_and_latest_leaves_the_committed_step_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user trial killed a worker of a 2-rank run just after step 19's folder was renamed (committed), before
    `latest` moved: `latest` stayed on step 18, and the run's own resume command was refused for good ("holds 1
    checkpoint(s) after step 18"). The next `latest` is now on disk before the rename, and discovery follows it."""
    from ckpt.cleanup import remove_interrupted_saves

    root = tmp_path / "checkpoints"
    save_simple(root, 5, seed=5)
    monkeypatch.setenv("MOECTL_CKPT_FAIL", "0:before_latest:crash")
    with pytest.raises(InjectedCrash):
        save_checkpoint(root, 10, THREE_FILES, make_meta())
    monkeypatch.delenv("MOECTL_CKPT_FAIL")
    assert (root / "latest").read_text() == "step_00000005\n"  # the kill's state
    (pending,) = root.glob("latest.tmp-*")
    assert pending.read_text() == "step_00000010\n"
    assert find_latest(root) == resolve_load_path(root) == root / "step_00000010"
    with open_checkpoint(root) as ck:
        assert ck.step == 10
    # a save killed before its rename leaves one naming no committed step: a leftover, not followed
    (root / "latest.tmp-0badc0de").write_text("step_00000015\n")
    (root / "latest.tmp-00000bad").write_text("junk")
    assert find_latest(root) == root / "step_00000010"
    # a run's start finishes the commit and removes the rest
    done = remove_interrupted_saves(root)
    assert done.latest == root / "step_00000010"
    assert (root / "latest").read_text() == "step_00000010\n" and not list(root.glob("latest.tmp-*"))
    assert remove_interrupted_saves(root).latest is None  # nothing more to do
    # an older pending pointer (a rollback written into `latest` by hand stays): never over a newer `latest`
    (root / "latest.tmp-0000beef").write_text("step_00000005\n")
    assert find_latest(root) == root / "step_00000010"
    (root / "latest").write_text("step_00000005\n")
    assert find_latest(root) == root / "step_00000005"


def test_a_clean_failure_removes_its_folder_and_names_the_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_simple(tmp_path, 5)
    monkeypatch.setenv("MOECTL_CKPT_FAIL", "0:before_manifest")
    with pytest.raises(CheckpointSaveError, match="failed on rank 0: InjectedFault") as err:
        save_checkpoint(tmp_path, 10, THREE_FILES, make_meta())
    assert err.value.ranks == [0] and not err.value.committed
    assert "latest is unchanged" in err.value.one_line()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000005"]


def test_fault_spec_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOECTL_CKPT_FAIL", "1:before_manifest")
    with pytest.raises(CheckpointSaveError, match="before_manifest happens on rank 0 only"):
        save_checkpoint(tmp_path, 1, THREE_FILES, make_meta())
    monkeypatch.setenv("MOECTL_CKPT_FAIL", "1:before_latest")
    with pytest.raises(CheckpointSaveError, match="before_latest happens on rank 0 only"):
        save_checkpoint(tmp_path, 1, THREE_FILES, make_meta())
    monkeypatch.setenv("MOECTL_CKPT_FAIL", "0:writ")
    with pytest.raises(CheckpointSaveError, match="each item must be"):
        save_checkpoint(tmp_path, 1, THREE_FILES, make_meta())


def test_discovery_ignores_folders_without_a_valid_manifest(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        save_simple(tmp_path, step)
    (tmp_path / "step_00000015" / "manifest.json").unlink()  # lost its commit marker
    (tmp_path / "step_00000020").mkdir()  # empty
    (tmp_path / "step_00000025.tmp-00ff").mkdir()
    (tmp_path / "step_00000030").mkdir()
    (tmp_path / "step_00000030" / "manifest.json").write_text("{not json")
    (tmp_path / "notes.txt").write_text("hi")
    assert list_committed(tmp_path) == [tmp_path / "step_00000005", tmp_path / "step_00000010"]
    assert [p.name for p in list_uncommitted(tmp_path)] == [
        "step_00000015", "step_00000020", "step_00000025.tmp-00ff", "step_00000030",
    ]  # fmt: skip
    (tmp_path / "latest").unlink()  # no tracker: the newest committed step
    assert find_latest(tmp_path) == tmp_path / "step_00000010"


def test_latest_is_trusted_and_a_bad_latest_is_a_clear_error(tmp_path: Path) -> None:
    save_simple(tmp_path, 5)
    save_simple(tmp_path, 10)
    (tmp_path / "latest").write_text("step_00000005\n")  # e.g. a crash between the rename and `latest`
    assert resolve_load_path(tmp_path) == tmp_path / "step_00000005"
    (tmp_path / "latest").write_text("step_00000099\n")
    with pytest.raises(CheckpointError, match="names step_00000099, which does not exist") as err:
        resolve_load_path(tmp_path)
    assert "fix: point checkpoint.load at " in err.value.one_line()  # the trainer's words, by default
    (tmp_path / "step_00000099").mkdir()
    with pytest.raises(CheckpointError, match="which has no manifest.json") as err:
        open_checkpoint(tmp_path)
    # the tools' own words (they take a path argument), naming a step that loads
    assert f"fix: pass a step folder such as {tmp_path / 'step_00000010'}, or delete latest" in err.value.one_line()
    (tmp_path / "latest").write_text("garbage")
    with pytest.raises(CheckpointError, match="holds 'garbage', not a step_NNNNNNNN folder name"):
        find_latest(tmp_path)


def test_a_wrong_load_path_is_an_error_never_a_fresh_start(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist") as err:
        resolve_load_path(tmp_path / "nope")
    assert "or to null to train from scratch" in err.value.one_line()
    run, sub = tmp_path / "run", tmp_path / "run" / "checkpoints"
    sub.mkdir(parents=True)
    with pytest.raises(CheckpointArgumentError, match=f"{run} is a run folder, not a checkpoint, and {sub} holds no "
                                                      "committed step"):  # fmt: skip
        resolve_load_path(run)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        open_checkpoint(tmp_path / "file")
    save_simple(sub, 3)
    assert resolve_load_path(sub / "step_00000003").name == "step_00000003"


def test_a_run_folder_given_as_a_checkpoint_is_usage_naming_the_checkpoint_to_give(tmp_path: Path) -> None:
    """A user trial: train's run_dir given as a checkpoint exited 1 (a bad checkpoint), a file there 2. It is the
    path's fault: exit 2, naming the checkpoints folder and the step it resolves to, in the caller's words."""
    run, sub = tmp_path / "run", tmp_path / "run" / "checkpoints"
    save_simple(sub, 2)
    save_simple(sub, 4)
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(CheckpointArgumentError) as err:
        resolve_load_path(run)
    assert err.value.exit_code == 2
    assert err.value.one_line() == (f"{run} is a run folder, not a checkpoint. "
                                    f"fix: point checkpoint.load at {sub} (its latest step, step_00000004)")
    for call in (open_checkpoint, verify_checkpoint):  # the tools' words
        with pytest.raises(CheckpointArgumentError) as err:
            call(run)
        assert err.value.one_line().endswith(f"fix: pass {sub} (its latest step, step_00000004)")
    (sub / "latest").write_text("step_00000099\n")  # a broken latest: the newest committed step, by itself
    with pytest.raises(CheckpointArgumentError) as err:
        resolve_load_path(run)
    assert err.value.one_line().endswith(f"fix: point checkpoint.load at {sub / 'step_00000004'}")


def test_the_checkpoint_tools_say_their_own_fix_not_the_trainers(tmp_path: Path) -> None:
    """`moectl ckpt convert/inspect/validate` have no checkpoint.load to set: their wrong-path errors say what to
    give them; a missing folder is "does not exist" everywhere (validate said "is not a folder")."""
    for call in (open_checkpoint, verify_checkpoint):
        with pytest.raises(CheckpointError, match="does not exist") as err:
            call(tmp_path / "nope")
        assert "checkpoint.load" not in err.value.one_line() and "step_NNNNNNNN folder" in err.value.one_line()
    with pytest.raises(CheckpointError, match="no committed checkpoint") as err:
        open_checkpoint(tmp_path)
    assert "checkpoint.load" not in err.value.one_line()


def test_a_file_given_as_a_checkpoint_is_worded_once(tmp_path: Path) -> None:
    """verify_checkpoint (`ckpt validate`) said "checkpoint path F is not a folder", the rest "is a file, not a
    checkpoint folder": one helper words it for all, exit 2, with the caller's fix."""
    (tmp_path / "file").write_text("x")
    lines = set()
    for call in (open_checkpoint, verify_checkpoint, resolve_load_path):
        with pytest.raises(CheckpointArgumentError) as err:
            call(tmp_path / "file")
        assert err.value.exit_code == 2
        lines.add(err.value.message)
    assert lines == {f"checkpoint path {tmp_path / 'file'} is a file, not a checkpoint folder"}


def test_a_folder_without_a_committed_step_is_usage_unless_it_is_a_checkpoints_folder(tmp_path: Path) -> None:
    """A user trial: an HF model folder or any folder that is no checkpoints folder exited 1, what a bad
    checkpoint gets. The path is wrong there (exit 2); a checkpoints folder whose run committed nothing yet
    (step_N/.tmp-/.trash- folders in it, or named `checkpoints`) is a real state and stays exit 1, saying so."""
    hf, other = tmp_path / "hf", tmp_path / "other"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model-00001-of-00002.safetensors").write_bytes(b"")
    other.mkdir()
    (other / "notes.txt").write_text("hi")
    for folder, said in ((hf, "it looks like a Hugging Face model folder"), (other, "it is not a checkpoints folder")):
        for call in (resolve_load_path, open_checkpoint, verify_checkpoint):
            with pytest.raises(CheckpointArgumentError, match=f"no committed checkpoint in {folder}; {said}") as err:
                call(folder)
            assert err.value.exit_code == 2
    with pytest.raises(CheckpointArgumentError) as err:
        resolve_load_path(other)  # the trainer's fix
    assert err.value.one_line().endswith("fix: set checkpoint.load to a step_NNNNNNNN folder or a checkpoints folder, "
                                         "or to null to train from scratch")
    for name in ("step_00000002.tmp-ab12", "step_00000004.trash-cd34", "step_00000006"):  # none committed
        (other / name).mkdir()
    for call in (resolve_load_path, open_checkpoint, verify_checkpoint):
        with pytest.raises(CheckpointError) as err:
            call(other)
        assert not isinstance(err.value, CheckpointArgumentError) and err.value.exit_code == 1
        assert err.value.message == (f"no committed checkpoint in {other}: no step was committed yet (uncommitted: "
                                     "step_00000002.tmp-ab12, step_00000004.trash-cd34 and 1 more)")
    (tmp_path / "checkpoints").mkdir()  # a run's, emptied (its interrupted saves removed when it restarted)
    with pytest.raises(CheckpointError) as err:
        resolve_load_path(tmp_path / "checkpoints")
    assert err.value.exit_code == 1 and err.value.message.endswith(": no step was committed yet")
    # A step whose manifest.json is there but damaged, no `latest`: a helper's trial was told "no step was committed
    # yet" and to "give a checkpoints folder", which it had given. The newest such step is named, and why.
    (other / "step_00000006" / "manifest.json").write_text('{"broken": ')
    for call in (resolve_load_path, open_checkpoint, verify_checkpoint):
        with pytest.raises(CheckpointError) as err:
            call(other)
        assert err.value.exit_code == 1 and err.value.message.startswith(f"no committed checkpoint in {other}: "
                                                                         "step_00000006 has a manifest.json that "
                                                                         "cannot be used (not valid JSON")
        assert err.value.message.endswith("so it counts as never committed")
        assert err.value.fix.startswith(f"run `moectl ckpt validate {other / 'step_00000006'}` to see what is wrong")
