"""The `--nproc-per-node` launcher around torchrun's agent (moectl/cli/launch.py), without starting workers: its
agent's `run` is replaced by one that leaves the workers' reports, so what happens after it returns can be
provoked exactly. Real workers and signals: test_train_process.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from cli_helpers import TINY, cli_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")

# A launcher whose workers have ended as `reports` says, and which gets `sig` right after the agent's run
# returns (as it reads the reports, before the verdict) and again as the process ends (at exit). `torchrun_handler`:
# a torch without --signals-to-handle, whose agent leaves its own handler installed.
LAUNCHER = """
import atexit, json, os, signal, sys
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler
from moectl.cli import launch

sig, torchrun_handler = signal.Signals[sys.argv[1]], sys.argv[2] == "1"
reports, argv = json.loads(sys.argv[3]), sys.argv[4:]

def run(args):
    if torchrun_handler:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, _terminate_process_handler)
    for r in reports:
        with open(os.path.join(os.environ["MOECTL_OUTCOME_DIR"], f"rank{r['rank']}.json"), "w") as f:
            json.dump(r, f)

def read_outcomes(d, real=launch.read_outcomes):
    os.kill(os.getpid(), sig)
    return real(d)

torchrun.run = run
launch.read_outcomes = read_outcomes
if torchrun_handler:
    launch._LauncherSignals.supported = staticmethod(lambda: False)
atexit.register(lambda: os.kill(os.getpid(), sig))
sys.argv = ["moectl", *argv]
from moectl.cli.app import main
main()
"""


def _stopped(rank: int, ckpt: Path) -> dict:
    return {"rank": rank, "kind": "stopped", "exit_code": 3, "step": 7, "checkpoint": str(ckpt), "signal": "SIGTERM"}


def _launch(tmp_path: Path, sig: signal.Signals, reports: list[dict],
            torchrun_handler: bool = False) -> subprocess.CompletedProcess[str]:  # fmt: skip
    argv = ["train", TINY, "--run-dir", str(tmp_path / "run"), "--set", "data.source=synthetic",
            "--nproc-per-node", "2"]  # fmt: skip
    cmd = [sys.executable, "-c", LAUNCHER, sig.name, "1" if torchrun_handler else "0", json.dumps(reports), *argv]
    return subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_after_the_workers_ended_keeps_the_code_the_run_earned(tmp_path: Path, sig: signal.Signals) -> None:
    """Both ranks stopped and saved (exit 3, what a scheduler requeues on); the launcher's own copy of the
    signal came after that. It ended the launcher: SIGINT with 130 and "stopped before `moectl train`
    finished", SIGTERM and SIGHUP killed it without a word (and a SIGINT as the interpreter finalized, after
    the exit handlers, killed it with -2: the same SIG_IGN covers that)."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000007"
    out = _launch(tmp_path, sig, [_stopped(0, ckpt), _stopped(1, ckpt)])
    assert (out.returncode, out.stderr) == (3, ""), out.stderr


def test_a_signal_after_the_workers_ended_keeps_the_runs_line_under_torchruns_handler(tmp_path: Path) -> None:
    """A torch without --signals-to-handle: torchrun's handler, still installed, raised its SignalException out of
    the launcher's report, with a traceback. The run's own line and code stand."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000007"
    failed = {"rank": 1, "kind": "error", "exit_code": 1, "step": 7, "message": "non-finite loss at step 7. fix: x"}
    out = _launch(tmp_path, signal.SIGTERM, [_stopped(0, ckpt), failed], torchrun_handler=True)
    assert (out.returncode, out.stderr.splitlines()) == (1, [f"error: rank 1, step 7: {failed['message']}"])


# `launch_local` (the benches' and parity's launcher) with an agent that leaves torchrun's handler installed (a
# torch without --signals-to-handle) and returns; then SIGTERM, as the command goes on to print its result.
LOCAL = """
import os, signal
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler
from moectl.cli import launch

def run(args):
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _terminate_process_handler)

torchrun.run = run
code = launch.launch_local(2, ["bench", "train", "--quick"])
os.kill(os.getpid(), signal.SIGTERM)
print("result", code)
"""


def test_a_signal_after_launch_local_returned_leaves_the_commands_result() -> None:
    """torchrun's handler raised its SignalException out of the bench's or parity's report (a traceback,
    exit 1) once the workers had ended; under SIG_DFL the process died silently. The result stands."""
    out = subprocess.run([sys.executable, "-c", LOCAL], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (0, "result 0\n", ""), out.stderr


@pytest.fixture
def deaf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen]:
    """A worker that ignores SIGINT, as one waiting in CUDA or NCCL does (its Python handler never runs), as rank 0
    of the report folder `tmp_path`; it ends when its stdin closes. This test process keeps its own handlers
    through the launcher's late-signal switch."""
    from moectl.cli import launch

    monkeypatch.setattr(launch, "_ignore_late_signals", lambda: None)
    p = subprocess.Popen([sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN);"
                          " print('ready', flush=True); sys.stdin.read()"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        (tmp_path / "pid0").write_text(str(p.pid))
        yield p
    finally:
        p.kill()


def _aborted(reports: Path, grace_s: float) -> Any:
    """A launcher's signals after two Ctrl-Cs: the stop request, then the abort (`grace_s`: its kill's wait)."""
    from moectl.cli.launch import _LauncherSignals

    signals = _LauncherSignals(reports, abort_grace_s=grace_s)
    signals.received = signal.SIGINT  # the first Ctrl-C, long enough ago
    signals._handle(signal.SIGINT, None)
    return signals


def test_an_aborted_worker_that_cannot_take_the_signal_is_killed_after_the_grace(
        tmp_path: Path, deaf: subprocess.Popen) -> None:
    """The second Ctrl-C's SIGINT does nothing to a worker waiting in CUDA or NCCL: the launcher kills what has
    not ended `abort_grace_s` after the abort."""
    from moectl.cli import outcome as O

    signals = _aborted(tmp_path, 0.3)
    try:
        assert (tmp_path / O.ABORT).exists()
        assert deaf.wait(timeout=10) == -signal.SIGKILL
    finally:
        signals.__exit__(None, None, None)


def test_the_kill_is_called_off_once_the_workers_have_ended(tmp_path: Path, deaf: subprocess.Popen) -> None:
    signals = _aborted(tmp_path, 0.5)
    signals.__exit__(None, None, None)  # the agent's run returned first
    with pytest.raises(subprocess.TimeoutExpired):
        deaf.wait(timeout=1.5)


def test_the_kill_spares_a_process_that_is_not_a_worker_and_a_run_that_ended(tmp_path: Path,
                                                                             deaf: subprocess.Popen) -> None:
    """The pids come from files: a worker that ended unreported left its pid to whatever came next. Only this
    process's own children (the agent's workers) are sent the abort's SIGINT and killed; and nothing once the
    agent's run has returned. (The stranger was a shell's `sleep 60 &`, and the SIGINT it was sent then killed it
    when it came before the shell's child had ignored SIGINT: a flaky test, and a signal to a stranger.)"""
    code = ("import os, signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); print(os.getpid(), flush=True); "
            "time.sleep(60)")  # SIGINT's default: the SIGINT a stranger must not get would end it
    stranger = subprocess.Popen(["sh", "-c", f"'{sys.executable}' -c '{code}' & wait"], stdout=subprocess.PIPE,
                                text=True, start_new_session=True)  # its child: not this process's  # fmt: skip
    signals = None
    try:
        assert stranger.stdout is not None
        other = int(stranger.stdout.readline())
        (tmp_path / "pid1").write_text(str(other))
        signals = _aborted(tmp_path, 60)
        signals.settled = True  # the run has ended: the kill does nothing
        signals._kill()
        assert deaf.poll() is None and Path(f"/proc/{other}").exists()
        signals.settled = False
        signals._kill()
        assert deaf.wait(timeout=10) == -signal.SIGKILL  # the worker
        assert Path(f"/proc/{other}").exists() and "Z" not in Path(f"/proc/{other}/stat").read_text().split()[2]
    finally:
        if signals is not None:  # its 60 s kill timer must not outlive the test: a later test's pid may be one of these
            signals.__exit__(None, None, None)
        os.killpg(stranger.pid, signal.SIGKILL)
        stranger.wait()


# The same through a bench command, whose signal handling (`base._signals_raise`) wraps `launch_local`: it put
# back the handlers it found (SIGTERM's default) as the command returned, undoing the late SIG_IGN.
BENCH = """
import atexit, os, signal, sys
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

def run(args):
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _terminate_process_handler)

torchrun.run = run
atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))
sys.argv = ["moectl", "bench", "param-gather", "--quick", "--nproc-per-node", "2"]
from moectl.cli.app import main
main()
"""


def test_a_signal_after_a_launched_bench_returned_leaves_its_exit_code() -> None:
    out = subprocess.run([sys.executable, "-c", BENCH], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stderr) == (0, ""), (out.returncode, out.stderr)


def test_the_abort_names_the_newest_committed_checkpoint_not_only_the_marked_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 marks a checkpoint when its main thread learns of the commit; killed while a background save
    committed a newer one (and retention removed the marked one), the line must name the newer one."""
    from ckpt import names
    from moectl.cli.launch import _newest_checkpoint

    root = tmp_path / "checkpoints"
    for step in (2, 3):
        (root / names.step_dir_name(step)).mkdir(parents=True)
        (root / names.step_dir_name(step) / names.MANIFEST).write_text("{}")
    (root / names.LATEST).write_text(names.step_dir_name(3))
    marked = str(root / names.step_dir_name(1))  # removed by retention since
    assert _newest_checkpoint(marked, str(root)) == str(root / names.step_dir_name(3))
    assert _newest_checkpoint(str(root / names.step_dir_name(2)), str(root)) == str(root / names.step_dir_name(3))
    assert _newest_checkpoint(None, str(root)) is None
    unread = str(tmp_path / "nothing" / "step_00000001")
    assert _newest_checkpoint(unread, str(tmp_path / "nothing")) == unread
    # A review: a resumed run marks the checkpoint it loaded; in another run's folder, whose later steps are that
    # run's, the mark is named as it is (the line had named the other run's step 3)
    loaded = str(root / names.step_dir_name(2))
    assert _newest_checkpoint(loaded, str(tmp_path / "run" / "checkpoints")) == loaded
    assert _newest_checkpoint(loaded, None) == loaded
    # a second review: the same folder spelled otherwise is the run's own; a run that saves nothing has no newer step
    monkeypatch.chdir(tmp_path)
    assert _newest_checkpoint(loaded, "checkpoints") == str(root / names.step_dir_name(3))
    assert _newest_checkpoint(loaded, str(root), saves=False) == loaded


# `launch_local` with a stand-in agent that logs what torchrun's does around a Ctrl-C.
LOCAL_LOGS = """
import logging, sys
import torch.distributed.run as torchrun
from moectl.cli import launch

def run(args):
    logging.getLogger("torch.distributed.elastic.agent.server.api").warning("Received 2 death signal, shutting down")
    logging.getLogger("torch.distributed.run").warning("Setting OMP_NUM_THREADS environment variable for each ...")

torchrun.run = run
print("result", launch.launch_local(2, ["bench", "train", "--quick"]))
"""


@pytest.mark.parametrize("debug", ["", "1"])
def test_launch_local_leaves_torchruns_logs_to_debug_runs(debug: str) -> None:
    """A launched bench or parity printed torchrun's OMP_NUM_THREADS banner on every run and its "Received 2
    death signal" and closing-signal lines above the one line of a Ctrl-C; `train` silences them."""
    out = subprocess.run([sys.executable, "-c", LOCAL_LOGS], env=cli_env(MOECTL_DEBUG=debug), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and out.stdout == "result 0\n", out.stderr
    assert ("Received 2 death signal" in out.stderr) == (debug == "1"), out.stderr


@pytest.mark.parametrize(("codes", "expected"), [({0: 2, 1: -15}, 2), ({0: 1, 1: 2}, 1), ({1: -9}, 1)])
def test_launch_local_passes_on_a_refusal_of_the_input_as_bad_usage(
    codes: dict[int, int], expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parity or bench run on N ranks whose data could not be read exited 1 ("different", "failed"), where one
    process exits 2; the first rank to fail decides (the rest were stopped by torchrun, or failed the same way)."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from moectl.cli import launch

    def run(args: Any) -> None:
        failures = {}
        for rank, code in codes.items():  # in order of time: the first entry is the first failure
            failures[rank] = ProcessFailure(local_rank=rank, pid=0, exitcode=code, error_file="")
            failures[rank].timestamp = rank
        raise ChildFailedError("moectl", failures)

    monkeypatch.setattr(torchrun, "run", run)
    monkeypatch.setattr(launch, "_ignore_late_signals", lambda: None)
    assert launch.launch_local(2, ["parity", "configs/tiny.yaml"]) == expected
