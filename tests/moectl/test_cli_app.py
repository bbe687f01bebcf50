"""The `moectl` entry point (moectl/cli/app.py `main`), run as a user runs it (a subprocess): a bad option value,
an unknown command or option and a missing argument are each one `error: ... fix: see ... -h` line on stderr with
exit code 2, as every other error (Typer's own handling drew a multi-line box); help and --version exit 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moectl", *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "COLUMNS": "100"})  # fmt: skip


@pytest.mark.parametrize(("args", "says"), [
    (("train", TINY, "--nproc-per-node", "abc"), "Invalid value for '--nproc-per-node'"),
    (("trainn",), "No such command 'trainn'. Did you mean 'train'?"),
    (("validate-config", TINY, "--bogus"), "No such option: --bogus"),
    (("ckpt", "convert"), "Missing argument"),
])  # fmt: skip
def test_usage_errors_are_one_line_with_exit_2(args: tuple[str, ...], says: str) -> None:
    r = _run(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.stderr
    assert "fix: see " in lines[0] and " -h" in lines[0] and "╭" not in r.stderr


def test_no_command_prints_the_help_and_no_error() -> None:
    """`moectl` (or `moectl ckpt`) alone: the help and click's exit code 2, no empty `error:` line after it."""
    for args in ((), ("ckpt",)):
        r = _run(*args)
        assert r.returncode == 2 and "Usage" in r.stdout + r.stderr and "error:" not in r.stderr, r.stderr


def test_help_and_version_exit_0() -> None:
    r = _run("validate-config", "--help")
    assert r.returncode == 0 and "Usage" in r.stdout
    r = _run("--version")
    assert r.returncode == 0 and r.stdout.startswith("moectl ")


def test_a_signal_inside_a_stoppable_command_raises_where_the_command_can_clean_up() -> None:
    import os
    import signal

    from moectl.cli.base import Stopped, _signals_raise

    previous = signal.getsignal(signal.SIGTERM)
    cleaned = False
    with pytest.raises(Stopped) as e, _signals_raise([]):
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the default would end pytest itself
        except Stopped:
            os.kill(os.getpid(), signal.SIGTERM)  # a second one during the cleanup is ignored: it runs to its end
            os.kill(os.getpid(), signal.SIGINT)
            cleaned = True
            raise
    assert cleaned and e.value.signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) is previous


def test_a_signal_ignored_before_a_stoppable_command_stays_ignored() -> None:
    """`nohup moectl ckpt convert ...`: a hang-up used to leave it running; it must not stop it now."""
    import os
    import signal

    from moectl.cli.base import _signals_raise

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with _signals_raise([]):
            os.kill(os.getpid(), signal.SIGHUP)  # nothing happens
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.parametrize("raised, code, name", [("term", 143, "SIGTERM"), ("int", 130, "SIGINT")])
def test_a_stopped_convert_is_one_line_with_the_signals_code(monkeypatch, tmp_path, raised, code, name) -> None:
    import signal

    from typer.testing import CliRunner

    import ckpt.convert
    from moectl.cli.app import app
    from moectl.cli.base import Stopped

    def stopped(*a, **kw):
        raise Stopped(signal.SIGTERM) if raised == "term" else KeyboardInterrupt

    monkeypatch.setattr(ckpt.convert, "convert_checkpoint", stopped)
    r = CliRunner().invoke(app, ["ckpt", "convert", str(tmp_path), str(tmp_path / "out"), "--layout", "per-expert"])
    assert r.exit_code == code, r.output
    assert r.output.strip() == (f"error: stopped by {name} before `moectl ckpt convert` finished; an unfinished "
                                "output is removed. fix: run it again (a destination that exists now was complete)")


def test_ctrl_c_in_any_other_command_is_one_line_and_130(monkeypatch) -> None:
    """Ctrl-C in a bench (or validate-config, parity...) ended with Typer's silent 130: no word of what stopped."""
    from typer.testing import CliRunner

    import moectl.cli.validate
    from moectl.cli.app import app

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(moectl.cli.validate, "check", interrupted)
    monkeypatch.delenv("MOECTL_LAUNCHED", raising=False)
    r = CliRunner().invoke(app, ["validate-config", "configs/tiny.yaml"])
    assert r.exit_code == 130, r.output
    assert r.output.strip() == "error: stopped by SIGINT before `moectl validate-config` finished. fix: run it again"


@pytest.mark.parametrize("after_a_signal", [False, True], ids=["peer-ended", "stopping"])
def test_a_launched_ranks_lost_peer_is_one_line_not_gloos_traceback(monkeypatch, after_a_signal) -> None:
    """A helper's trial: Ctrl-C on `bench train --nproc-per-node 2` printed, 1 time in 8, a worker's gloo
    "Connection closed by peer" traceback: the other worker had taken the signal and ended first. A rank whose
    collective lost its peer says so in one line (exit 1), or, when a stop signal had reached it too, stops as
    that signal asks (its launcher says so, once)."""
    import os
    import signal
    import sys

    import torch.distributed  # noqa: F401  (a rank that may have joined a process group)
    from typer.testing import CliRunner

    from moectl.cli.base import command, new_app

    bench = new_app("b", "a bench's stand-in")

    @command(bench, name="run", interruptible=True)
    def run() -> None:
        if after_a_signal:
            try:
                os.kill(os.getpid(), signal.SIGTERM)  # the command's handler raises Stopped here
            except BaseException:
                pass  # as if it landed while the main thread waited inside the collective
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                           "[127.0.0.1]:29500")

    @bench.callback()
    def _group() -> None:  # a group, so `run` is a subcommand
        pass

    assert "torch.distributed" in sys.modules
    from moectl.cli.base import _lost_peer

    monkeypatch.setenv("WORLD_SIZE", "2")
    hung = RuntimeError("NCCL communicator was aborted on rank 1. Watchdog caught collective operation timeout")
    assert _lost_peer(hung) is None  # a hang, which is no peer that ended first: left as it is
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MOECTL_LAUNCHED", "1")  # a worker: its launcher says the stop once
    r = CliRunner().invoke(bench, ["run"])
    assert "Traceback" not in r.output and not isinstance(r.exception, RuntimeError), (r.output, r.exception)
    if after_a_signal:
        assert (r.exit_code, r.output.strip()) == (143, "")
    else:
        assert r.exit_code == 1 and r.output.strip() == (
            "error: rank 1 lost a peer in a collective: another rank ended first (Connection closed by peer "
            "[127.0.0.1]:29500). fix: see that rank's own line, or the launcher's"), r.output


@pytest.mark.parametrize("signum, code", [(2, 130), (15, 143)])
def test_a_launched_bench_stopped_by_a_signal_is_one_line_not_torchruns_traceback(monkeypatch, signum, code) -> None:
    """`bench train --nproc-per-node 2` and Ctrl-C: torchrun's SignalException ended the command with its
    traceback and exit 1."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from typer.testing import CliRunner

    from moectl.cli.app import app

    def stopped(args):
        raise SignalException(f"Process 1 got signal: {signum}", sigval=signum)

    monkeypatch.setattr(torch.distributed.run, "run", stopped)
    monkeypatch.delenv("MOECTL_LAUNCHED", raising=False)
    r = CliRunner().invoke(app, ["bench", "train", "configs/tiny.yaml", "--quick", "--nproc-per-node", "2"])
    name = "SIGINT" if signum == 2 else "SIGTERM"
    assert r.exit_code == code, r.output
    assert r.output.strip() == f"error: stopped by {name} before `moectl bench train` finished. fix: run it again"


# A bench whose measurement gets `sig` (module.attr replaced by a function that sends it to this process), run
# from the entry point as a user runs it: a real signal, at a known point, in a process the test can lose.
SIGNALLED_BENCH = """
import importlib, os, signal, sys, time

module, attr, sig = sys.argv[1], sys.argv[2], signal.Signals[sys.argv[3]]

def signalled(*args, **kwargs):
    os.kill(os.getpid(), sig)
    time.sleep(60)  # the handler raises out of this sleep

setattr(importlib.import_module(module), attr, signalled)
sys.argv = ["moectl", *sys.argv[4:]]
from moectl.cli.app import main
main()
"""


@pytest.mark.parametrize("sig, target, args", [
    ("SIGTERM", "moectl.bench.train_bench.run", ("train", TINY, "--quick")),
    ("SIGHUP", "moectl.bench.train_bench.run", ("train", TINY, "--quick")),
    ("SIGTERM", "moectl.bench.grouped_mlp.run", ("grouped-mlp", "--quick")),
    ("SIGTERM", "moectl.bench.ckpt_bench.run", ("ckpt", TINY, "--quick")),
], ids=["train-sigterm", "train-sighup", "grouped-mlp-sigterm", "ckpt-sigterm"])  # fmt: skip
def test_a_bench_stopped_by_sigterm_is_one_line_as_for_ctrl_c(tmp_path: Path, sig: str, target: str,
                                                               args: tuple[str, ...]) -> None:  # fmt: skip
    """One process, no launcher: SIGTERM (a scheduler's stop, `timeout`) and SIGHUP ended a bench on the spot with
    no word (Ctrl-C said which command stopped); now the same line, 128 + the signal, no traceback."""
    import signal

    from cli_helpers import cli_env

    module, attr = target.rsplit(".", 1)
    cmd = [sys.executable, "-c", SIGNALLED_BENCH, module, attr, sig, "bench", *args]
    if args[0] == "ckpt":
        cmd += ["--dir", str(tmp_path / "bench")]
    r = subprocess.run(cmd, env=cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 128 + signal.Signals[sig], r.stderr
    assert r.stderr.splitlines() == [f"error: stopped by {sig} before `moectl bench {args[0]}` finished. fix: run it "
                                     "again"]  # fmt: skip


# A command as one rank of two: torch.distributed loaded (as any multi-rank command loads it), an exit handler
# that says whether the interpreter's normal exit ran.
RANK_OF_TWO = """
import atexit, os, sys
import torch.distributed
os.environ["WORLD_SIZE"] = sys.argv[1]
atexit.register(lambda: print("interpreter exit", flush=True))
sys.argv = ["moectl", "config", "keys", "optimizer.lr"]
from moectl.cli.app import main
main()
"""


@pytest.mark.parametrize("world", ["2", "1"])
def test_a_rank_of_a_multi_rank_command_leaves_without_the_interpreters_exit(world: str) -> None:
    """gloo's threads can abort a multi-rank process's normal exit ("terminate called without an active
    exception": exit 1 after a finished `bench param-gather --nproc-per-node 2`, 1 run in 5), as they did
    `train`'s ranks before those left with os._exit: every command's rank now leaves so, its output flushed;
    one process exits normally."""
    from cli_helpers import cli_env

    r = subprocess.run([sys.executable, "-c", RANK_OF_TWO, world], env=cli_env(), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "optimizer.lr" in r.stdout  # the command's output, flushed before the exit
    assert ("interpreter exit" in r.stdout) == (world == "1")
