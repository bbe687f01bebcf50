"""The Typer app object and the decorator every command goes through.

`command` registers a function on an app and turns a `MoectlError` into one red line
(`error: ... fix: ...`) and the error's exit code; `MOECTL_DEBUG=1` prints the traceback before that line.
Doing it per command (rather than around `app()`) keeps it working under Typer's test runner.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import sys
import traceback
import warnings
from typing import Any, Callable, Iterator, TypeVar

import typer

from moectl.cli import exit_codes
from moectl.cli.console import say, stdout_reader_gone, stdout_to_devnull
from moectl.core.environment import says_it_once, unknown_variables
from moectl.core.errors import DataError, MoectlError, UsageError
from moectl.core.stop_signals import STOP_SIGNALS

F = TypeVar("F", bound=Callable[..., Any])


def new_app(name: str, help: str) -> typer.Typer:
    """A Typer app (or sub-app) with moectl's settings."""
    return typer.Typer(
        name=name,
        help=help,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode="rich",
        context_settings={"help_option_names": ["-h", "--help"]},
    )


def _one_line_warning(message: Any, category: type, filename: str, lineno: int, line: Any = None) -> str:
    """A warning as the CLI shows it: `warning: <message>` (the default adds the file, line and source)."""
    return f"warning: {' '.join(str(message).split())}\n"


if os.environ.get("MOECTL_DEBUG") != "1":
    warnings.formatwarning = _one_line_warning  # type: ignore[assignment]


app = new_app("moectl", "Train mixture-of-experts transformers on one or many GPUs and manage their checkpoints.")


def _version(value: bool) -> None:
    if value:
        from moectl import __version__

        typer.echo(f"moectl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Train mixture-of-experts transformers on one or many GPUs and manage their checkpoints."""
    # A callback keeps `moectl` a command group even if only one command were registered.


def report(e: MoectlError, prefix: str = "") -> None:
    """Print a user error as one line on stderr (`prefix`: e.g. `rank 1: ` in a multi-rank run); a config with
    several bad keys gets one line for each."""
    for line in e.lines():
        say(f"error: {prefix}{line}", "red")


def warn_unknown_variables() -> None:
    """Name each `MOECTL_*` environment variable moectl does not read (a mistyped switch would change nothing
    silently); once per run: a worker of moectl's launcher, or a rank other than 0, leaves it to another."""
    if not says_it_once(os.environ):
        return
    for line in unknown_variables(os.environ):
        say(f"warning: {line}", "yellow")


class Stopped(BaseException):
    """SIGTERM or SIGHUP during a stoppable command (a BaseException, as KeyboardInterrupt is: cleanups that
    catch everything still run, and nothing treats it as an ordinary error)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_raise(fired: list[int]) -> Iterator[None]:
    """While inside: the first SIGINT, SIGTERM or SIGHUP raises (KeyboardInterrupt, `Stopped`) in the main thread,
    where the command's cleanup runs (the default of the last two ends the process on the spot, leaving a partial
    output behind); from then on all three are ignored, so a second one cannot cut the cleanup short. A signal
    already ignored (`nohup`'s SIGHUP) stays ignored. `fired` collects the signals taken, for an error raised
    in their wake (`_lost_peer`)."""
    saved: dict[int, Any] = {}

    def handle(signum: int, frame: Any) -> None:
        fired.append(signum)
        for sig in saved:
            signal.signal(sig, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Stopped(signum)

    for sig in STOP_SIGNALS:
        try:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                saved[sig] = signal.signal(sig, handle)
        except ValueError:  # not the main thread (a test runner's worker): the defaults stay
            pass
    try:
        yield
    finally:
        for sig, previous in saved.items():
            # only what this block set: a handler set inside it stays (`launch._ignore_late_signals`, once a
            # launched bench's workers have ended, or a late signal kills the bench with no line)
            current = signal.getsignal(sig)
            if current is handle or (fired and current is signal.SIG_IGN):
                signal.signal(sig, previous)


@contextlib.contextmanager
def data_errors_are_usage() -> Iterator[None]:
    """Inside: data that cannot be read as configured is bad input, exit 2, as under `train` (a `DataError` raised
    becomes a `UsageError`): its own code, 1, reads "failed" to a script, and "different" from `parity`."""
    try:
        yield
    except DataError as e:
        raise UsageError(e.message, e.fix) from e


#: a collective that timed out (NCCL's watchdog text says "communicator was aborted" too): a hang, not a peer gone
_TIMED_OUT = re.compile(r"timed out|timeout|watchdog", re.IGNORECASE)


def distributed_worker() -> bool:
    """Whether this process is one rank of several that may have joined a process group (torchrun's WORLD_SIZE,
    and torch.distributed imported: a command that never loaded torch has no group to race)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world > 1 and "torch.distributed" in sys.modules


def _lost_peer(e: Exception) -> MoectlError | None:
    """One rank of a launched multi-rank command (a bench, parity) whose collective lost its peer: the other rank
    ended first (a Ctrl-C reached it sooner, or it failed and says why in its own line). As a `MoectlError`
    (one line), where it was gloo's "Connection closed by peer" traceback; None for any other error."""
    if not distributed_worker():
        return None
    from trainer.parallel.failures import collective_failure

    failure = collective_failure(e, int(os.environ.get("RANK", "0")), None, 0.0)
    if failure is None or failure.kind != "peer-lost" or _TIMED_OUT.search(str(e)):  # NCCL's watchdog: a hang
        return None
    return MoectlError(f"rank {failure.rank} lost a peer in a collective: another rank ended first "
                       f"({failure.detail})", "see that rank's own line, or the launcher's")


def _name(target: typer.Typer, fn: Callable[..., Any], name: str | None) -> str:
    """The command as typed: `moectl ckpt convert`."""
    own = name or fn.__name__.removesuffix("_command").replace("_", "-")
    group = target.info.name if target is not app else None
    return " ".join(p for p in ("moectl", group, own) if isinstance(p, str))


def command(target: typer.Typer = app, name: str | None = None, stoppable: bool = False,
            interruptible: bool = False, **kwargs: Any) -> Callable[[F], F]:
    """Register `fn` as a command of `target`, with one-line user errors.

    `stoppable`: SIGTERM and SIGHUP stop the command as Ctrl-C does, by an exception in the main thread (so
    its cleanup removes a partial output) instead of ending the process where it stands; a second signal
    cannot interrupt that cleanup (`_signals_raise`). One line says so, and the exit code is 128 + the
    signal's number. For commands that write: `train` has its own.

    `interruptible`: the same handling for a command with no output to remove (the benches), whose line is
    Ctrl-C's (`stopped by SIGTERM before ... finished. fix: run it again`); without it SIGTERM and SIGHUP
    end the process on the spot, with no line.
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kw: Any) -> Any:
            warn_unknown_variables()
            fired: list[int] = []
            try:
                try:
                    if not (stoppable or interruptible):
                        return fn(*args, **kw)
                    with _signals_raise(fired):
                        return fn(*args, **kw)
                except Exception as e:
                    lost = _lost_peer(e)
                    if lost is None:
                        raise
                    if fired:  # the stop reached the peer first, and its exit broke this rank's collective
                        raise Stopped(fired[0]) from None
                    raise lost from e  # MOECTL_DEBUG=1 shows the backend's traceback under it
            except (KeyboardInterrupt, Stopped) as e:
                signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
                if not stoppable:
                    # Typer ends a Ctrl-C with a silent 130 (a launcher's `Stopped`: see launch_local): say which
                    # command stopped, once per command (not from every worker of a launched bench), and keep
                    # the shell's code for that signal
                    if says_it_once(os.environ):
                        say(f"error: stopped by {signal.Signals(signum).name} before `{_name(target, fn, name)}`"
                            " finished. fix: run it again", "red")  # fmt: skip
                    raise typer.Exit(exit_codes.stopped_unsaved(signum)) from None
                what = f"{signal.Signals(signum).name} before `{_name(target, fn, name)}` finished"
                say(f"error: stopped by {what}; an unfinished output is removed. fix: run it again (a "
                    "destination that exists now was complete)", "red")  # fmt: skip
                raise typer.Exit(exit_codes.stopped_unsaved(signum)) from None
            except MoectlError as e:
                if os.environ.get("MOECTL_DEBUG") == "1":  # the traceback on top: the line and exit code stay
                    traceback.print_exc()
                report(e)
                raise typer.Exit(e.exit_code) from None
            except BrokenPipeError as e:
                if not stdout_reader_gone():  # another pipe broke (a child process's): a failure to see, which
                    raise RuntimeError(f"a pipe broke: {e}") from e  # click would turn into a silent exit 1
                # the reader left (`| head`): click would exit 1, the code of "violations"
                stdout_to_devnull()
                raise typer.Exit(exit_codes.reader_gone()) from None

        target.command(name, **kwargs)(wrapper)
        return fn

    return decorate
