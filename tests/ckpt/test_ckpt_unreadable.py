"""A checkpoints folder, step folder or `latest` file this user may not read (ckpt/discovery.py): one line naming
the path and the OS's reason, with a fix, exit 2, in `ckpt inspect` (plain, --json, --verify), `ckpt validate`,
`ckpt convert` and a resume. They ended in a PermissionError traceback from ckpt/discovery.py (exit 1).

These tests run as root, whom chmod 000 does not stop: `deny` makes the OS refuse as it refuses a user without
CAP_DAC_OVERRIDE (a folder cannot be listed nor anything in it reached; a file cannot be opened). The one test
that uses a real chmod runs only as another user.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from ckpt_fixtures import save_simple
from typer.testing import CliRunner

from ckpt import list_committed, manifest, resolve_load_path
from ckpt import problems as P
from ckpt.reader import open_checkpoint
from moectl.cli.app import app
from moectl.core.errors import CheckpointArgumentError

runner = CliRunner()
FAST = [
    "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=16", "moe.num_experts=4", "moe.ffn_hidden_size=16", "train.micro_batch_size=2",
    "train.global_batch_size=4", "data.source=synthetic", "train.eval_interval=null", "optimizer.lr_warmup_iters=0",
]  # fmt: skip


def deny(monkeypatch: pytest.MonkeyPatch, target: Path) -> None:
    """Make `target` unreadable as `chmod 000` does for an ordinary user."""
    target = target.absolute()
    is_dir = target.is_dir()

    def refused(p: Any) -> bool:
        p = Path(p).absolute()
        return target in p.parents if is_dir else p == target

    def refuse(p: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(p))

    stat, iterdir, open_ = Path.stat, Path.iterdir, Path.open

    def guarded_stat(self: Path, *a: Any, **k: Any) -> Any:
        if is_dir and refused(self):  # stat of the file itself needs no permission on it, only on its folder
            refuse(self)
        return stat(self, *a, **k)

    def guarded_iterdir(self: Path) -> Any:
        if is_dir and self.absolute() == target:
            refuse(self)
        return iterdir(self)

    def guarded_open(self: Path, *a: Any, **k: Any) -> Any:
        if refused(self):
            refuse(self)
        return open_(self, *a, **k)

    access = os.access

    def guarded_access(p: Any, mode: int, *a: Any, **k: Any) -> bool:
        if is_dir and (Path(p).absolute() == target or refused(p)):  # no search (x) on it, nothing reachable below
            return False
        return access(p, mode, *a, **k)

    monkeypatch.setattr(Path, "stat", guarded_stat)
    monkeypatch.setattr(Path, "iterdir", guarded_iterdir)
    monkeypatch.setattr(Path, "open", guarded_open)
    monkeypatch.setattr(os, "access", guarded_access)


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    """A checkpoints folder with two committed steps, `latest` naming the second."""
    save_simple(tmp_path / "ck", 2)
    save_simple(tmp_path / "ck", 4)
    return tmp_path / "ck"


# what is made unreadable -> the path the error names
TARGETS = {"latest": ("latest", "latest"), "step": ("step_00000004", "step_00000004")}


def _one_error_line(r: Any) -> str:
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)  # not a crash
    assert "Traceback" not in r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


@pytest.mark.parametrize("what", list(TARGETS))
def test_an_unreadable_latest_or_step_folder_is_an_argument_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, root: Path, what: str
) -> None:
    target, named = TARGETS[what]
    deny(monkeypatch, root / target)
    for call in (lambda: resolve_load_path(root), lambda: open_checkpoint(root, verify=False)):
        with pytest.raises(CheckpointArgumentError) as e:
            call()
        assert e.value.exit_code == 2
        line = e.value.one_line()
        assert f"{root / named} cannot be read: Permission denied. fix: make it readable by this user" in line, line


def test_an_unenterable_folder_further_out_is_the_one_named(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """A folder above the checkpoints one (`home/`) was denied, and the error sent the user to `home/runs`."""
    deny(monkeypatch, root.parent.parent)  # two levels out: the folder holding the checkpoints' own folder
    with pytest.raises(CheckpointArgumentError) as e:
        open_checkpoint(root, verify=False)
    assert e.value.one_line().startswith(f"{root.parent.parent.absolute()} cannot be read: Permission denied"), e.value


def test_a_step_folder_given_directly_names_itself(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    deny(monkeypatch, root / "step_00000004")
    with pytest.raises(CheckpointArgumentError, match=r"step_00000004 cannot be read: Permission denied"):
        open_checkpoint(root / "step_00000004")


def test_an_unenterable_step_folder_is_unreadable_not_uncommitted(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """manifest.load says why it cannot look (it said "missing: the save never committed", or raised)."""
    deny(monkeypatch, root / "step_00000004")
    m, problems = manifest.load(root / "step_00000004")
    assert m is None and [(p.kind, p.message) for p in problems] == [
        (P.UNREADABLE, "the folder cannot be read: Permission denied")
    ]
    assert list_committed(root) == [root / "step_00000002"]  # retention never deletes what it cannot see


@pytest.mark.parametrize("older", [True, False], ids=["older-step", "no-other-step"])
def test_without_latest_a_newer_step_this_user_may_not_read_is_named_not_skipped(
        monkeypatch: pytest.MonkeyPatch, root: Path, older: bool) -> None:
    """A review: with no `latest`, a step whose manifest.json this user may not read was passed over for an older
    committed step without a word (or, with none older, called never committed, exit 1); a chmod is all that is
    wrong, and it is `denied`'s one line, exit 2, naming the file."""
    (root / "latest").unlink()
    if not older:  # the unreadable step is the only one
        for f in (root / "step_00000002").iterdir():
            f.unlink()
        (root / "step_00000002").rmdir()
    deny(monkeypatch, root / "step_00000004" / "manifest.json")
    for call in (resolve_load_path, open_checkpoint):
        with pytest.raises(CheckpointArgumentError, match=r"step_00000004/manifest.json cannot be read: Permission "
                                                          r"denied") as e:  # fmt: skip
            call(root)
        assert e.value.exit_code == 2


@pytest.mark.parametrize("what", list(TARGETS))
@pytest.mark.parametrize("command", ["inspect", "inspect --json", "inspect --verify", "validate", "convert"])
def test_ckpt_commands_say_it_in_one_line_exit_2(
    monkeypatch: pytest.MonkeyPatch, root: Path, tmp_path: Path, what: str, command: str
) -> None:
    target, named = TARGETS[what]
    args = ["ckpt", *command.split(), str(root)]
    if command == "convert":
        args += [str(tmp_path / "out"), "--layout", "per-expert"]
    deny(monkeypatch, root / target)
    r = runner.invoke(app, args, env={"COLUMNS": "200", "MOECTL_DEBUG": ""})
    assert r.exit_code == 2, r.output
    if command == "inspect --json":  # JSON on stdout for its reader, the line on stderr for a person
        out = json.loads(r.stdout)
        assert out["readable"] is False and f"{root / named} cannot be read" in out["problems"][0]
        line = r.stderr.strip()
        assert len(line.splitlines()) == 1 and line.startswith("error: ") and "Traceback" not in r.output
    else:
        line = _one_error_line(r)
    assert f"{root / named} cannot be read: Permission denied" in line and "fix:" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("what", list(TARGETS))
def test_train_resume_says_it_in_one_line_exit_2(
    monkeypatch: pytest.MonkeyPatch, root: Path, tmp_path: Path, what: str
) -> None:
    target, named = TARGETS[what]
    deny(monkeypatch, root / target)
    r = runner.invoke(app, ["train", "configs/tiny.yaml", *[a for s in FAST for a in ("--set", s)],
                            "--set", f"checkpoint.load={root}", "--run-dir", str(tmp_path / "run")],
                      env={"MOECTL_DEBUG": ""})  # fmt: skip
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{root / named} cannot be read: Permission denied" in errors[0], r.output
    assert "Traceback" not in r.output


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads through chmod 000")
def test_a_real_chmod_000(root: Path) -> None:
    for target in (root / "latest", root / "step_00000004"):
        target.chmod(0)
        try:
            r = runner.invoke(app, ["ckpt", "inspect", str(root)], env={"MOECTL_DEBUG": ""})
            assert r.exit_code == 2 and f"{target} cannot be read: Permission denied" in _one_error_line(r)
        finally:
            target.chmod(0o755 if target.name.startswith("step_") else 0o644)


def deny_file(monkeypatch: pytest.MonkeyPatch, target: Path, err: int = errno.EACCES) -> None:
    """Make opening file `target` fail with `err` (EACCES: as `chmod 000` does for an ordinary user), through
    `open` and pathlib alike; its folder stays readable and its stat works, as they do after a chmod."""
    import builtins
    import io

    target = target.absolute()
    real_open, real_io_open = builtins.open, io.open

    def guarded(real: Any) -> Any:
        def open_(file: Any, *a: Any, **k: Any) -> Any:
            if not isinstance(file, int) and Path(file).absolute() == target:
                raise OSError(err, os.strerror(err), str(file))
            return real(file, *a, **k)

        return open_

    monkeypatch.setattr(builtins, "open", guarded(real_open))
    monkeypatch.setattr(io, "open", guarded(real_io_open))  # pathlib's read_bytes/open


# a file inside the step folder this user may not read: it named the file but called the checkpoint bad (exit 1,
# `ckpt validate` "invalid") and sent the user to "load another step", where a folder's refusal is exit 2 and a chmod
FILES = ["manifest.json", "model-00000.safetensors", "optim-00000.safetensors"]


@pytest.mark.parametrize("fname", FILES)
def test_a_denied_file_in_the_step_is_an_argument_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, root: Path, fname: str
) -> None:
    from ckpt import verify_checkpoint

    step = root / "step_00000004"
    deny_file(monkeypatch, step / fname)
    calls = [lambda: verify_checkpoint(root), lambda: open_checkpoint(root)]
    if fname == "manifest.json":  # without hashing only the manifest is read
        calls.append(lambda: open_checkpoint(root, verify=False))
    for call in calls:
        with pytest.raises(CheckpointArgumentError) as e:
            call()
        assert e.value.exit_code == 2
        line = e.value.one_line()
        assert line.startswith(f"{step / fname} cannot be read: Permission denied. fix: make it readable"), line


@pytest.mark.parametrize("fname", FILES)
@pytest.mark.parametrize("command", ["inspect", "inspect --verify", "validate", "convert"])
def test_ckpt_commands_say_a_denied_file_in_one_line_exit_2(
    monkeypatch: pytest.MonkeyPatch, root: Path, tmp_path: Path, fname: str, command: str
) -> None:
    if command == "inspect" and fname != "manifest.json":
        pytest.skip("plain inspect reads the manifest only")
    args = ["ckpt", *command.split(), str(root)]
    if command == "convert":
        args += [str(tmp_path / "out"), "--layout", "per-expert"]
    deny_file(monkeypatch, root / "step_00000004" / fname)
    r = runner.invoke(app, args, env={"COLUMNS": "200", "MOECTL_DEBUG": ""})
    assert r.exit_code == 2, r.output
    line = _one_error_line(r)
    assert f"{root / 'step_00000004' / fname} cannot be read: Permission denied" in line and "fix:" in line
    assert not (tmp_path / "out").exists()


def test_train_resume_says_a_denied_file_in_one_line_exit_2(
    monkeypatch: pytest.MonkeyPatch, root: Path, tmp_path: Path
) -> None:
    deny_file(monkeypatch, root / "step_00000004" / "optim-00000.safetensors")
    r = runner.invoke(app, ["train", "configs/tiny.yaml", *[a for s in FAST for a in ("--set", s)],
                            "--set", f"checkpoint.load={root}", "--run-dir", str(tmp_path / "run")],
                      env={"MOECTL_DEBUG": ""})  # fmt: skip
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "optim-00000.safetensors cannot be read: Permission denied" in errors[0], r.output


def test_an_io_error_stays_a_problem_of_the_checkpoint(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Only this user's permissions make it the command's fault: a file the disk fails to read is the checkpoint's
    problem (exit 1, `ckpt validate` invalid), as before."""
    from ckpt import verify_checkpoint

    deny_file(monkeypatch, root / "step_00000004" / "optim-00000.safetensors", errno.EIO)
    problems = verify_checkpoint(root)
    assert [(p.kind, p.file) for p in problems] == [(P.UNREADABLE, "optim-00000.safetensors")], problems
