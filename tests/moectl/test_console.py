"""The console's closed stdout (moectl/cli/console.py): a run whose pipe reader left goes on, and says so;
any other command ends with 141, as a shell tool killed by SIGPIPE does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from moectl.cli.console import make_console
c = make_console(outlive_stdout={outlive})
for i in range(2000):  # 400 KB: past the pipe buffer
    c.print("step", i, "x" * 200)
print("still running at the end", file=sys.stderr)
"""


@pytest.mark.parametrize("outlive", [True, False])
def test_a_closed_stdout_silences_the_run_console_instead_of_ending_the_process(outlive: bool) -> None:
    """`moectl train ... | head`: the run's console goes on. Other commands' console ends the process with 141
    (Rich's default exits 1 with no word, which `pipefail` reads as the command's verdict)."""
    p = subprocess.Popen([sys.executable, "-c", SCRIPT.format(outlive=outlive)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)  # fmt: skip
    assert p.stdout is not None and p.stderr is not None
    p.stdout.read(100)
    p.stdout.close()  # the reader leaves, as `head` does
    err = p.stderr.read().decode()
    code = p.wait(timeout=60)
    if outlive:
        assert code == 0 and "stdout was closed by its reader" in err and "still running at the end" in err, err
    else:
        assert code == 141 and "still running at the end" not in err and err == "", err


def test_validate_config_into_a_closed_pipe_exits_141_not_1() -> None:
    """`moectl validate-config tiny.yaml | head -1` under `set -o pipefail`: 1 would say "violations"."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line
    try:
        r = subprocess.run([sys.executable, "-m", "moectl", "validate-config", str(REPO / "configs" / "tiny.yaml")],
                           stdout=write_end, stderr=subprocess.PIPE, cwd=REPO, timeout=120)  # fmt: skip
    finally:
        os.close(write_end)
    assert r.returncode == 141 and r.stderr == b"", r.stderr


def test_every_command_console_is_wide_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a pipe Rich assumes 80 columns: parity's and the benches' tables were squeezed ("grad norm" over
    "OFF", shapes cut to "64,…") where they built a bare Console instead of `make_console`."""
    import pathlib
    import re

    from typer.testing import CliRunner

    from moectl.cli.app import app

    root = pathlib.Path(__file__).resolve().parents[2]
    bare = [str(p.relative_to(root)) for p in (root / "moectl").rglob("*.py")
            if p.name != "console.py" and re.search(r"(?<![\w.])Console\(", p.read_text())]
    assert bare == []
    monkeypatch.delenv("COLUMNS", raising=False)
    res = CliRunner().invoke(app, ["parity", "configs/tiny.yaml", "--set", "train.global_batch_size=4",
                                   "--set", "data.source=synthetic", "--flag", "optimizer.lr=1e-3", "--steps", "1"])
    assert res.exit_code == 1, res.output  # the lr differs
    assert "grad norm OFF" in res.output


def test_a_plain_echo_into_a_closed_pipe_exits_141_and_another_broken_pipe_is_an_error(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """typer.echo (not Rich) meets the closed pipe too: `ckpt inspect --json` prints its JSON that way. A broken
    pipe that is not stdout's (a child process's) is not a reader leaving: it surfaces."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([sys.executable, "-m", "moectl", "ckpt", "inspect", str(tmp_path / "none"), "--json"],
                           stdout=write_end, stderr=subprocess.PIPE, cwd=REPO, timeout=120)  # fmt: skip
    finally:
        os.close(write_end)
    assert r.returncode == 141 and b"Traceback" not in r.stderr, r.stderr

    from typer.testing import CliRunner

    import ckpt.inspect
    from moectl.cli.app import app

    def broken(*a, **kw):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(ckpt.inspect, "inspect_checkpoint", broken)
    result = CliRunner().invoke(app, ["ckpt", "inspect", str(tmp_path)])
    assert isinstance(result.exception, RuntimeError) and "a pipe broke" in str(result.exception)
    assert isinstance(result.exception.__cause__, BrokenPipeError) and result.exit_code != 141


@pytest.mark.parametrize("args", [["--help"], ["bench", "train", "--help"]])
def test_help_into_a_closed_pipe_exits_141_not_1(args: list[str]) -> None:
    """`moectl --help | head -1` exited 1: Typer renders help through its own Rich console, whose broken-pipe
    exit is 1, outside every command's console."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([sys.executable, "-m", "moectl", *args], stdout=write_end, stderr=subprocess.PIPE, cwd=REPO,
                           timeout=120)  # fmt: skip
    finally:
        os.close(write_end)
    assert r.returncode == 141 and r.stderr == b"", r.stderr



@pytest.mark.parametrize("no_color, red", [("1", False), ("", True)])
def test_error_lines_are_plain_under_no_color(no_color: str, red: bool) -> None:
    """`NO_COLOR=1 moectl train` on a terminal still printed its `error:` line in red (click's secho ignores
    NO_COLOR; Rich's tables honour it). An empty NO_COLOR means unset (no-color.org)."""
    import pty

    leader, follower = pty.openpty()  # a terminal: off one, click strips the colour anyway
    try:
        r = subprocess.run([sys.executable, "-m", "moectl", "train"], stdout=follower, stderr=follower, cwd=REPO,
                           env={**os.environ, "NO_COLOR": no_color}, timeout=120)  # fmt: skip
        out = os.read(leader, 65536)
    finally:
        os.close(leader)
        os.close(follower)
    assert r.returncode == 2 and b"error: Missing argument 'config'" in out, out
    assert (b"\x1b[31m" in out) is red, out
