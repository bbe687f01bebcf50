"""`launcher_tie.tie_to_launcher`: only the launcher's own child, on Linux, ties itself (the kill itself is
`test_train_process.py::test_workers_of_a_launcher_killed_outright_stop_save_and_end`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moectl.cli.launcher_tie import LAUNCHER_PID_ENV, tie_to_launcher

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")


def test_no_tie_without_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    assert tie_to_launcher() is False
    monkeypatch.setenv(LAUNCHER_PID_ENV, "not a pid")
    assert tie_to_launcher() is False


def test_no_tie_for_a_process_whose_parent_is_not_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process a worker starts in turn inherits the variable; its parent is the worker, not the launcher (here:
    a live process other than the parent, this one, so the launcher is alive and nothing is signalled; a pid
    that may not exist would be a dead launcher, and the SIGTERM would end the test run)."""
    monkeypatch.setenv(LAUNCHER_PID_ENV, str(os.getpid()))
    assert tie_to_launcher() is False


@linux
def test_the_launchers_child_is_tied_and_keeps_running() -> None:
    code = "from moectl.cli.launcher_tie import tie_to_launcher; print(tie_to_launcher())"
    env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "True"), out.stderr


@linux
def test_a_worker_whose_launcher_died_during_its_start_up_stops() -> None:
    """A review: a launcher killed while its workers were still starting left them orphaned (reparented, the
    parent check skipped the tie, and they waited on the dead agent's store until the collective timeout)."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=60).stdout.strip()  # fmt: skip
    code = "from moectl.cli.launcher_tie import tie_to_launcher; tie_to_launcher(); import time; time.sleep(30)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, LAUNCHER_PID_ENV: gone},
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == -15, (out.returncode, out.stderr)  # SIGTERM at once, not 30 s of waiting
