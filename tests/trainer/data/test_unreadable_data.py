"""A data file that exists but cannot be read is one line naming the file, the OS's reason and the fix.

It was a 20-line traceback (exit 1) for every source. These tests run as root too, where chmod 000 stops
nothing, so they make the OS refuse by patching `open`, `os.stat` or `mmap` for the chosen paths only; the
one test with a real chmod runs only where chmod 000 stops this user.
"""

from __future__ import annotations

import builtins
import errno
import mmap
import os
from array import array
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moectl.cli.app import app
from moectl.core.config.schema import DataConfig
from moectl.core.errors import DataError
from trainer.data import build_data, load_source
from trainer.data.sources.tokens import llmc_header

from test_data_sources import DOCS, write_megatron

IDS = [i % 200 for i in range(3000)]


def _error(code: int) -> OSError:
    return OSError(code, os.strerror(code))  # OSError picks the subclass: EACCES -> PermissionError


def refuse_open(monkeypatch: pytest.MonkeyPatch, *paths: Path | str, code: int = errno.EACCES) -> None:
    """Opening any of `paths` fails with `code`, as opening a mode-000 file does for a user who is not root."""
    refused = {os.path.abspath(p) for p in paths}
    real_open = builtins.open

    def fake_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, os.PathLike)) and os.path.abspath(file) in refused:
            raise _error(code)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)


def refuse_stat_under(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Everything under `folder` fails to stat with EACCES, as in a mode-000 folder for a user who is not root."""
    real_stat = os.stat

    def fake_stat(path: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(path, (str, os.PathLike)) and os.path.abspath(path).startswith(f"{folder}{os.sep}"):
            raise _error(errno.EACCES)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", fake_stat)


def write_tokens(path: Path) -> Path:
    path.write_bytes(array("H", IDS).tobytes())
    return path


def write_source(source: str, folder: Path) -> tuple[DataConfig, Path]:
    """A readable dataset of `source` in `folder`: its config, and the file the source opens."""
    if source == "megatron-bin" or source == "megatron-idx":
        write_megatron(folder / "d", DOCS * 100)
        return DataConfig(source="megatron", path=str(folder / "d")), folder / f"d.{source[-3:]}"
    if source == "text-txt":
        (folder / "t.txt").write_text("hello world\n" * 100)
        return DataConfig(source="text", path=str(folder / "t.txt")), folder / "t.txt"
    if source == "text-jsonl":
        (folder / "t.jsonl").write_text('{"text": "hello world"}\n' * 100)
        return DataConfig(source="text", path=str(folder / "t.jsonl")), folder / "t.jsonl"
    dtype = "uint16" if source == "tokens-dtype" else None
    return DataConfig(source="tokens", path=str(write_tokens(folder / "t.bin")), dtype=dtype), folder / "t.bin"


SOURCES = ["tokens", "tokens-dtype", "text-txt", "text-jsonl", "megatron-bin", "megatron-idx"]


def assert_unreadable(err: DataError, path: Path, reason: str, key: str = "data.path") -> None:
    line = err.one_line()
    assert "\n" not in line and f"{path}: cannot be read ({reason}). fix: " in line, line
    assert key in (err.fix or ""), line


@pytest.mark.parametrize("source", SOURCES)
def test_a_file_that_cannot_be_opened_names_it_and_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    cfg, target = write_source(source, tmp_path)
    load_source(cfg, vocab_size=256, seed=0)  # readable, it loads
    refuse_open(monkeypatch, target)
    with pytest.raises(DataError) as e:
        load_source(cfg, vocab_size=256, seed=0)
    assert_unreadable(e.value, target, "Permission denied")
    assert "chmod a+r" in (e.value.fix or "")


@pytest.mark.parametrize("source", ["tokens", "text-txt", "megatron-idx"])
def test_a_file_in_a_folder_this_user_may_not_search_is_unreadable_not_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """`os.path.isfile` is False for it, which said "no such file" about a file that is there."""
    locked = tmp_path / "locked"
    locked.mkdir()
    cfg, target = write_source(source, locked)
    refuse_stat_under(monkeypatch, locked)
    with pytest.raises(DataError) as e:
        load_source(cfg, vocab_size=256, seed=0)
    assert_unreadable(e.value, target, "Permission denied")


def test_an_unreadable_eval_file_names_data_eval_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train, held = write_tokens(tmp_path / "train.bin"), write_tokens(tmp_path / "val.bin")
    refuse_open(monkeypatch, held)
    cfg = DataConfig(source="tokens", path=str(train), eval_path=str(held))
    with pytest.raises(DataError) as e:
        build_data(cfg, seq_length=16, vocab_size=256, seed=0)
    assert e.value.message.startswith("data.eval_path: ")
    assert_unreadable(e.value, held, "Permission denied", key="data.eval_path")


def test_failures_to_read_or_map_an_open_file_name_the_os_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_tokens(tmp_path / "t.bin")

    def no_mmap(*args: Any, **kwargs: Any) -> mmap.mmap:
        raise _error(errno.ENODEV)

    monkeypatch.setattr(mmap, "mmap", no_mmap)
    with pytest.raises(DataError) as e:
        load_source(DataConfig(source="tokens", path=str(path)), vocab_size=256, seed=0)
    assert_unreadable(e.value, path, "No such device")
    assert "chmod" not in (e.value.fix or "")  # not a permission problem

    class FailingFile:
        def __enter__(self) -> FailingFile:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def read(self, *args: Any) -> bytes:
            raise _error(errno.EIO)

    monkeypatch.setattr(builtins, "open", lambda *args, **kwargs: FailingFile())
    with pytest.raises(DataError) as e:
        llmc_header(str(path))
    assert_unreadable(e.value, path, "Input/output error")


def test_a_real_mode_000_file_is_unreadable(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.bin")
    path.chmod(0)
    try:
        if os.access(path, os.R_OK):
            pytest.skip("this user reads a mode-000 file (root); the patched tests above stand in for it")
        with pytest.raises(DataError) as e:
            load_source(DataConfig(source="tokens", path=str(path)), vocab_size=256, seed=0)
    finally:
        path.chmod(0o644)
    assert_unreadable(e.value, path, "Permission denied")


SMALL = ["--set", "train.train_iters=2", "--set", "model.seq_length=32", "--set", "optimizer.lr_warmup_iters=0"]


@pytest.mark.parametrize("key", ["data.path", "data.eval_path"])
def test_train_on_an_unreadable_file_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    """Nothing was trained: bad input, exit 2 (moectl/cli/exit_codes.py), one line and no traceback."""
    good, bad = write_tokens(tmp_path / "good.bin"), write_tokens(tmp_path / "bad.bin")
    refuse_open(monkeypatch, bad)
    paths = {"data.path": bad, "data.eval_path": good} if key == "data.path" else {"data.path": good, key: bad}
    sets = [x for k, p in paths.items() for x in ("--set", f"{k}={p}")]
    res = CliRunner().invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--set", "data.source=tokens", *sets,
                                   "--run-dir", str(tmp_path / "r")], env={"MOECTL_DEBUG": ""})  # fmt: skip
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert res.exit_code == 2 and len(errors) == 1 and "Traceback" not in res.output, res.output
    assert f"{bad}: cannot be read (Permission denied). fix: " in errors[0] and key in errors[0].split("fix:")[1]
