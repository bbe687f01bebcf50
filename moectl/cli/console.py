"""The Rich console every command prints through: terminal-aware, and never wrapping in a log file.

Off a terminal (a cluster job's log, a pipe, `tee`) Rich assumes 80 columns, so tables and the run's
banner wrapped mid-word ("77,815 tok...", "bal 7....", issue 18). There the console is as wide as
`OFF_TERMINAL_WIDTH`: every line keeps its natural width, and a log file holds what a terminal would show
on a wide enough screen. `COLUMNS`, when set, still wins (Rich reads it), for anyone who wants wrapping.
"""

from __future__ import annotations

import os

from rich.console import Console

OFF_TERMINAL_WIDTH = 4096


def make_console(*, quiet: bool = False, stderr: bool = False) -> Console:
    """A console for this process's stdout (or stderr); wide off a terminal unless COLUMNS says otherwise."""
    console = Console(quiet=quiet, stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(quiet=quiet, stderr=stderr, width=OFF_TERMINAL_WIDTH)
    return console
