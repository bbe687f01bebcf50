"""The Rich console every command prints through: terminal-aware, and never wrapping in a log file.

Off a terminal (a cluster job's log, a pipe, `tee`) Rich assumes 80 columns, so tables and the run's
banner wrapped mid-word ("77,815 tok...", "bal 7....", issue 18). There the console is as wide as
`OFF_TERMINAL_WIDTH`: every line keeps its natural width, and a log file holds what a terminal would show
on a wide enough screen. `COLUMNS`, when set, still wins (Rich reads it), for anyone who wants wrapping.
"""

from __future__ import annotations

import os
import select
import sys

import typer
from rich.console import Console

from moectl.cli import exit_codes

OFF_TERMINAL_WIDTH = 4096


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no real fd (a test runner's stream), or no poll
        return False


def stdout_to_devnull() -> None:
    """Later plain prints and the interpreter's last flush go nowhere, quietly. Best effort: stdout may be no
    file descriptor at all (a test runner)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def say(line: str, color: str) -> None:
    """Print one `error:` or `warning:` line on stderr, in `color` on a terminal; plain under `NO_COLOR` (set and
    not empty, as no-color.org has it), which Rich honours for the tables but click's `secho` does not."""
    typer.secho(line, err=True, fg=None if os.environ.get("NO_COLOR") else color)


class CommandConsole(Console):
    """A console whose command ends when the reader of its stdout goes away (`moectl validate-config ... | head
    -1`): with 141, the code of a shell tool killed by SIGPIPE. Rich's default exits 1, which a `pipefail` script
    reads as the command's own verdict (violations, a failed check)."""

    def on_broken_pipe(self) -> None:
        """Rich calls this on `BrokenPipeError`."""
        self.quiet = True
        stdout_to_devnull()
        raise SystemExit(exit_codes.reader_gone())


class RunConsole(Console):
    """A console whose process outlives its stdout: when the reader of a pipe goes away (`moectl train ... |
    head`), Rich's default ends the process with exit code 1 and no word, mid-run and without a save. Here the
    output is sent to /dev/null from then on, one line on stderr says so, and the run goes on."""

    def on_broken_pipe(self) -> None:
        """Go quiet and keep running (Rich calls this on `BrokenPipeError`). Best effort past `quiet`: stderr may be
        the same closed pipe (`2>&1 | head`), and stdout may be no file descriptor at all (a test runner)."""
        self.quiet = True
        stdout_to_devnull()
        try:
            print("warning: stdout was closed by its reader; the run goes on without printing progress",
                  file=sys.stderr, flush=True)  # fmt: skip
        except (OSError, ValueError):
            pass


def make_console(*, quiet: bool = False, stderr: bool = False, outlive_stdout: bool = False) -> Console:
    """A console for this process's stdout (or stderr); wide off a terminal unless COLUMNS says otherwise.
    `outlive_stdout`: a closed stdout silences it instead of ending the process (`RunConsole`); else a closed
    stdout ends the command with 141 (`CommandConsole`)."""
    cls = RunConsole if outlive_stdout else CommandConsole
    console = cls(quiet=quiet, stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = cls(quiet=quiet, stderr=stderr, width=OFF_TERMINAL_WIDTH)
    return console
