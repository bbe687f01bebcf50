"""`--json PATH` files: written whole or not at all; a failed write is one error line (moectl/cli/output.py)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_helpers import takes_no_file
from moectl.cli import output
from moectl.cli.app import app
from moectl.cli.output import OutputError, write_json_file


def test_the_file_is_written_whole_with_the_usual_mode(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text("old")
    write_json_file(path, {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left


def test_a_full_disk_is_one_error_and_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench train --json /dev/full` ended in a traceback (OSError: No space left on device); on a real full
    disk `write_text` also left a truncated file a script would read as the result."""
    path = tmp_path / "r.json"
    path.write_text('{"old": true}\n')

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(output.os, "fsync", full)
    with pytest.raises(OutputError) as e:
        write_json_file(path, {"new": True})
    assert e.value.exit_code == 1
    assert e.value.one_line().startswith(f"cannot write --json {path}: No space left on device. fix: ")
    assert path.read_text() == '{"old": true}\n'  # the previous file stands; nothing half-written
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_device_is_written_in_place_not_replaced() -> None:
    with pytest.raises(OutputError, match="No space left on device"):
        write_json_file(Path("/dev/full"), {"a": 1})
    assert Path("/dev/full").is_char_device()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_bench_json_to_a_full_device_is_one_line_exit_1() -> None:
    res = CliRunner().invoke(app, ["bench", "grouped-mlp", "--quick", "--no-fp8", "--json", "/dev/full"])
    assert res.exit_code == 1, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert errors == ["error: cannot write --json /dev/full: No space left on device. fix: free space there or "
                      "give another path; the results above are complete"], res.output
    assert "Traceback" not in res.output


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd")
def test_a_link_is_kept_and_a_link_into_proc_is_written_through(tmp_path: Path) -> None:
    """A review: `--json /dev/stdout > out.txt` replaced the /dev/stdout link itself with a file (as root), and a
    link to a results file became a plain file with its target left stale. The link stays; what it names is
    written (in place through /proc, replaced whole for a regular file elsewhere)."""
    real = tmp_path / "real.json"
    real.write_text("{}\n")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_json_file(link, {"b": 2})
    assert link.is_symlink() and json.loads(real.read_text()) == {"b": 2}
    stdout = tmp_path / "stdout"
    stdout.symlink_to("/proc/self/fd/1")
    code = ("from pathlib import Path; from moectl.cli.output import write_json_file; "
            f"write_json_file(Path({str(stdout)!r}), {{'a': 1}})")
    redirected = tmp_path / "redirected.txt"
    with open(redirected, "w") as f:
        subprocess.run([sys.executable, "-c", code], stdout=f, check=True, timeout=60)
    assert stdout.is_symlink() and json.loads(redirected.read_text()) == {"a": 1}


def test_the_probe_asks_the_os_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The option checked the folder's permission bits, which pass for root: `--json` into a read-only mount or
    /sys ran the whole command and failed at its end. The probe makes and removes a file where the write will."""
    assert output.unwritable(tmp_path / "r.json") is None
    assert list(tmp_path.iterdir()) == []

    def read_only(*_: object, **__: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(output.tempfile, "mkstemp", read_only)
    assert output.unwritable(tmp_path / "r.json") == f"{tmp_path} takes no new file (Read-only file system)"
    if Path("/dev/full").exists():  # written in place: a probe would write into the device; the write answers
        assert output.unwritable(Path("/dev/full")) is None


@pytest.mark.skipif(not takes_no_file(Path("/sys")), reason="needs a folder that takes no new file")
def test_sys_is_refused_even_to_root() -> None:
    # the reason is the OS's: "Permission denied", or "Read-only file system" where /sys is mounted so
    reason = output.unwritable(Path("/sys/r.json"))
    assert reason is not None and reason.startswith("/sys takes no new file ("), reason
