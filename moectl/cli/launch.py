"""`--nproc-per-node N`: start N local processes through torch's own elastic launcher, and report on them.

We do not hand-roll process management: `torch.distributed.run` (torchrun) gives rendezvous, per-rank
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), log prefixes and "one rank died, stop
the others". Multi-node runs use torchrun directly:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m moectl train CONFIG

What this launcher adds around torchrun (issue 18):
- each worker reports how it ended (moectl/cli/outcome.py), and the run ends with one line naming the
  rank, the step and the cause (moectl/cli/verdict.py) and the documented exit code, instead of the
  agent's 25-50 line traceback and error table (both still shown with `MOECTL_DEBUG=1`);
- SIGTERM/SIGINT/SIGHUP to the launcher reach the workers through the agent, which then gives them torchrun's
  shutdown timeout (`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, default 30 s, as Slurm's KillWait) to finish the
  step and save before it kills them; a second Ctrl-C is forwarded to every worker as a SIGINT, which aborts
  the run without saving (`_LauncherSignals`);
- a worker stops (SIGTERM: it saves and exits 3) when the launcher is killed outright (`launcher_tie`);
- once the workers have ended, a late SIGINT/SIGTERM/SIGHUP to the launcher is ignored: the run's line and
  exit code are what the workers earned (`_ignore_late_signals`);
- the workers' CPU threads are chosen by the trainer's rule (trainer/threads.py) and passed as
  OMP_NUM_THREADS, unless the user set it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Optional

from moectl.cli import exit_codes
from moectl.cli.launcher_tie import LAUNCHER_PID_ENV
from moectl.cli.outcome import (
    OUTCOME_DIR_ENV,
    abort_requested,
    read_checkpoint,
    read_checkpoint_root,
    read_outcomes,
    read_pids,
    read_started,
    request_abort,
)
from moectl.cli.verdict import Exit, Verdict, verdict
from moectl.core.environment import LAUNCHED_ENV
from moectl.core.stop_signals import STOP_SIGNALS

def under_torchrun() -> bool:
    """True inside a process that torchrun (or this launcher) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _debug() -> bool:
    return os.environ.get("MOECTL_DEBUG") == "1"


def _quiet_torchrun() -> None:
    """The agent logs every worker's exit and shutdown at WARNING/ERROR; our verdict line replaces that.

    torch gives each of its modules' loggers its own level (torch/distributed/elastic/utils/logging.py),
    so each one already created is silenced, not just a parent; the agent's modules are imported by now.
    """
    if _debug():
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch_local(nproc_per_node: int, moectl_args: list[str]) -> int:
    """Run `python -m moectl <moectl_args>` in `nproc_per_node` local processes; returns 0, 2 if the first rank to
    fail refused its input as bad usage or config (exit 2), or 1 if any failed otherwise.

    For commands whose workers do not report (the benches, parity): each worker says its own error line, and
    torchrun's logs (its OMP_NUM_THREADS banner, its "Received 2 death signal" and closing-signal lines around a
    Ctrl-C) are silenced as for `train`, except with MOECTL_DEBUG=1.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from moectl.cli.base import Stopped

    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc_per_node}", "--module", "moectl", *moectl_args]
    )
    _quiet_torchrun()
    os.environ[LAUNCHED_ENV] = "1"  # the workers leave this process's notices to it
    try:
        run(args)
    except ChildFailedError as e:  # torchrun already printed each failed rank's error
        # Every rank reads the same config and data, so a rank that refused them (2) speaks for the run, as one
        # process would; 1 would tell a script "failed" (parity: "different") for a typo in a data path.
        _, first = e.get_first_failure()
        return exit_codes.USAGE if first.exitcode == exit_codes.USAGE else exit_codes.FAILED
    except SignalException as e:  # Ctrl-C or SIGTERM: torchrun stopped the workers; the command says it in one line
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise Stopped(e.sigval) from None
    finally:
        del os.environ[LAUNCHED_ENV]
        _ignore_late_signals()  # the workers have ended: the command's own line and code stand
    return 0


def _ignore_late_signals() -> None:
    """Ignore SIGINT, SIGTERM and SIGHUP for the rest of this process, once the agent's run has returned.

    The workers have ended by then, so such a signal has nothing left to stop: the run's outcome is settled,
    and reporting it takes milliseconds. Handled as before, it ended the launcher in that window without its
    line or the code the run earned (3 after a save, which a scheduler requeues on): a KeyboardInterrupt ("stopped
    before `moectl train` finished"), torchrun's handler raising out of the report, or SIGTERM's default
    killing it. SIG_IGN rather than a Python handler: the interpreter puts its own handlers back to SIG_DFL as
    it finalizes, and a late Ctrl-C there killed the launcher with -2 after a run that had finished.
    """
    for sig in STOP_SIGNALS:
        try:
            signal.signal(sig, signal.SIG_IGN)
        except ValueError:  # not the main thread (a test runner's worker): nothing was handled here either
            pass


class _LauncherSignals:
    """The launcher's SIGINT, SIGTERM and SIGHUP while the workers run (entered around torchrun's `run`).

    The first goes the way torchrun's own handler sends it: raised as its `SignalException`, on which the agent
    forwards it to every worker and waits up to its shutdown timeout for them to stop and save. torchrun's
    handler raised again on a second Ctrl-C, out of that wait, and the agent's clean-up then sent the workers
    SIGTERM, which a stopping worker takes as the same request: the second Ctrl-C never reached them, and they
    saved and exited 3. Here a later SIGINT is sent on as it is to each worker that has not reported (their ids:
    `outcome.mark_pid`), after the launcher's word that it aborts (`outcome.request_abort`), and the agent goes
    on waiting for them; one that has not ended `ABORT_GRACE_S` later is killed (`_kill`). A SIGINT within
    `REPEAT_GRACE_S` of the first, and a later SIGTERM or SIGHUP, change nothing, as on a worker. The workers
    lead their own sessions, so a terminal's Ctrl-C reaches only this process: each press reaches a worker once.

    torchrun must leave these three signals to this handler (`ARGS`); a torch whose launcher has no
    `--signals-to-handle` takes them over when it starts the workers, and a second Ctrl-C there is lost as before.
    """

    #: torchrun's own handling, for the signals this class does not take (its default: all four)
    ARGS = ["--signals-to-handle=SIGQUIT"]
    #: Seconds an aborted worker has to end before it is killed. One whose main thread waits in CUDA or NCCL
    #: (a collective its aborted peer left) never runs its Python handler: on two GPUs both ranks sat out
    #: torchrun's 30 s shutdown timeout after a second Ctrl-C and died without a word (device tool, H200s).
    ABORT_GRACE_S = 5.0

    def __init__(self, reports: Path, abort_grace_s: float = ABORT_GRACE_S) -> None:
        from trainer.stop import REPEAT_GRACE_S

        self.reports = reports
        self.received: Optional[signal.Signals] = None
        self.received_at = 0.0
        #: a SIGINT this soon after the first is the same request, as on a worker (trainer/stop.py): a wrapper in
        #: the terminal's process group forwards the Ctrl-C the launcher got too, and that must not abort
        self.repeat_grace_s = REPEAT_GRACE_S
        self.settled = False
        self.abort_grace_s = abort_grace_s
        self._killer: Optional[threading.Timer] = None
        self._lock = threading.Lock()  # the kill and the end of the run: one after the other, never across

    @staticmethod
    def supported() -> bool:
        """Whether this torch's launcher can be told which signals to leave alone (`ARGS`)."""
        from torch.distributed.launcher.api import LaunchConfig

        return "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)}

    def __enter__(self) -> "_LauncherSignals":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        """The workers have ended: from here on the three signals are ignored, not handed back to the previous
        handlers (`_ignore_late_signals`)."""
        with self._lock:  # after a kill in progress, and none after this
            self.settled = True  # first: a signal already pending must not raise out of the switch below
        _ignore_late_signals()
        if self._killer is not None:
            self._killer.cancel()
            self._killer.join()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if self.settled:
            return
        sig = signal.Signals(signum)
        if self.received is None:
            self.received, self.received_at = sig, time.monotonic()
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
        if sig != signal.SIGINT or time.monotonic() - self.received_at < self.repeat_grace_s:
            return
        request_abort(self.reports)  # before the SIGINT: the workers abort on this word, not on a count
        self._send(sig)
        if self._killer is None:  # the abort does not wait for a worker that cannot take it
            self._killer = killer = threading.Timer(self.abort_grace_s, self._kill)
            killer.daemon = True
            killer.start()

    def _kill(self) -> None:
        """SIGKILL to each worker that has still not reported, unless the run has ended meanwhile. Only a process
        that is this launcher's child: the agent starts the workers as its children and reaps them, so a pid a
        dead worker left to another process (once reaped) fails the check, where a pid read from a file could
        name anything by now."""
        with self._lock:
            if self.settled:
                return
            for pid in read_pids(self.reports).values():
                if _is_child(pid):
                    _signal_worker(pid, signal.SIGKILL)

    def _send(self, sig: signal.Signals) -> None:
        """`sig` to each worker that has not reported how it ended; not to a process /proc shows is no child of
        this one (a worker that ended unreported left its pid to whatever came next: see `_kill`)."""
        for pid in read_pids(self.reports).values():
            parent = _parent_of(pid)
            if parent is None or parent == os.getpid():  # None: no /proc to ask (or already gone)
                _signal_worker(pid, sig)


def _signal_worker(pid: int, sig: signal.Signals) -> None:
    """`sig` to worker `pid`'s whole process group, as torch signals a worker (its children too); to the process
    alone when it leads none; nothing when it has just ended."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _is_child(pid: int) -> bool:
    """Whether `pid` is a child of this process (`/proc/<pid>/stat`'s parent id; False where it cannot tell)."""
    return _parent_of(pid) == os.getpid()


def _parent_of(pid: int) -> Optional[int]:
    """`pid`'s parent process id from `/proc/<pid>/stat`, or None where it cannot tell (no /proc, no such pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...; comm may hold spaces
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def _newest_checkpoint(marked: Optional[str], root: Optional[str], saves: bool = True) -> Optional[str]:
    """The run's newest committed checkpoint, from the one rank 0 marked: the workers may have been killed while
    a background save committed a newer one (and retention removed the marked one). Looked for only in a run
    that `saves`, and when the mark lies in the run's own checkpoints folder `root` (`outcome.mark_checkpoint_root`;
    the same folder however spelled): before its first save, or never saving, a resumed run marks the checkpoint
    it loaded, and another run's folder may hold that run's later steps."""
    if (marked is None or root is None or not saves
            or os.path.realpath(Path(marked).parent) != os.path.realpath(root)):  # fmt: skip
        return marked
    from ckpt.discovery import find_latest  # here: the checkpoint format is not needed to launch

    try:
        newest = find_latest(Path(marked).parent)
    except Exception:  # noqa: BLE001 - the mark stands when its folder cannot be read
        return marked
    return str(newest) if newest is not None else marked


def launch_train(nproc_per_node: int, moectl_args: list[str], cpu_threads: Optional[int] = None,
                 saves: bool = False) -> Verdict:
    """Run `python -m moectl train ...` in `nproc_per_node` local processes; returns the run's verdict.

    `cpu_threads`: OMP_NUM_THREADS for each worker (None: leave it to torchrun, e.g. on a GPU run). `saves`:
    whether the run saves checkpoints (the verdict's fix for a run that ended with none).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if cpu_threads is not None and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(cpu_threads)  # also keeps torchrun from printing its own advice
    _quiet_torchrun()
    with tempfile.TemporaryDirectory(prefix="moectl-outcome-") as reports:
        os.environ[OUTCOME_DIR_ENV] = reports
        os.environ[LAUNCHED_ENV] = "1"  # the workers leave this process's notices to it
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # they stop if this process dies (launcher_tie.py)
        own = _LauncherSignals.supported()  # else torchrun's handler, which loses a second Ctrl-C
        args = get_args_parser().parse_args(
            [*(_LauncherSignals.ARGS if own else []), "--standalone", f"--nproc-per-node={nproc_per_node}",
             "--module", "moectl", *moectl_args]
        )  # fmt: skip
        exits: dict[int, Exit] = {}
        launcher_signal = None
        signals = _LauncherSignals(Path(reports)) if own else contextlib.nullcontext()
        try:
            with signals:
                run(args)
        except ChildFailedError as e:
            for rank, f in e.failures.items():
                exits[int(rank)] = Exit(f.exitcode, f.signal_name() if f.exitcode < 0 else None, f.timestamp)
            if _debug():
                print(e, file=sys.stderr)
        except SignalException as e:
            launcher_signal = e.sigval.name
        finally:
            # here too: torchrun's own handler stays installed on a torch without --signals-to-handle, and a
            # first signal that lands as `__exit__` is called raises out of it before its switch
            _ignore_late_signals()
            del os.environ[OUTCOME_DIR_ENV]
            del os.environ[LAUNCHED_ENV]
            del os.environ[LAUNCHER_PID_ENV]
        d = Path(reports)
        return verdict(nproc_per_node, read_outcomes(d), exits, launcher_signal, saves, read_started(d),
                       aborted=abort_requested(d),
                       checkpoint=_newest_checkpoint(read_checkpoint(d), read_checkpoint_root(d), saves))  # fmt: skip


def reexec_args() -> list[str]:
    """This process's moectl arguments without `--nproc-per-node`, for the children."""
    out, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if arg in ("--nproc-per-node", "--nproc_per_node"):
            skip = True
            continue
        if arg.startswith(("--nproc-per-node=", "--nproc_per_node=")):
            continue
        out.append(arg)
    return out
