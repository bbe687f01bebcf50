"""The `moectl` command: imports every command module (each registers itself on `app`)."""

from __future__ import annotations

import sys

import typer

from moectl.cli import exit_codes
from moectl.cli.base import app, distributed_worker
from moectl.cli.console import say, stdout_to_devnull
from moectl.cli import validate  # noqa: F401
from moectl.cli import bench  # noqa: F401
from moectl.cli import bench_train  # noqa: F401
from moectl.cli import bench_ckpt  # noqa: F401
from moectl.cli import train  # noqa: F401
from moectl.cli import ckpt  # noqa: F401
from moectl.cli import parity  # noqa: F401
from moectl.cli import config_cmd  # noqa: F401

__all__ = ["app", "main"]


def main() -> None:
    """Console entry point. A bad flag, option value or command name is one line with its fix, as every other
    error (Typer would draw a multi-line box under a usage line); help and exit codes are Typer's."""
    usage_error, click_error = _click_errors()
    try:
        code = app(standalone_mode=False)
    except usage_error as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `moectl` or `moectl ckpt` alone: the help is printed
            sys.exit(e.exit_code)
        where = e.ctx.command_path if e.ctx is not None else "moectl"
        message = " ".join(e.format_message().split())
        stop = "" if message.endswith((".", "?", "!")) else "."
        say(f"error: {message}{stop} fix: see {where} -h", "red")
        sys.exit(e.exit_code)
    except click_error as e:  # e.g. a file option that cannot be opened
        say(f"error: {' '.join(e.format_message().split())}", "red")
        sys.exit(e.exit_code)
    except typer.Abort:  # Ctrl-C while click itself waited (a prompt)
        say("error: aborted", "red")
        sys.exit(130)
    except SystemExit as e:
        # Help into a closed pipe (`moectl --help | head -1`): Rich's console (which has sent stdout to /dev/null
        # already) and Typer end it with 1 while handling the BrokenPipeError, outside any command's console;
        # 141 as for every command's own output (exit_codes.py)
        if e.code == 1 and isinstance(e.__context__, BrokenPipeError):
            stdout_to_devnull()
            sys.exit(exit_codes.reader_gone())
        raise
    code = code if isinstance(code, int) else 0
    if distributed_worker():
        # as train's ranks leave (docs/design.md, "A multi-rank worker leaves with os._exit"): gloo's threads can
        # abort a normal interpreter exit ("terminate called without an active exception", exit 1 after a
        # finished `bench param-gather --nproc-per-node 2`, 1 run in 5 on 2 CPU cores)
        exit_codes.end_process(code)
    sys.exit(code)


def _click_errors() -> tuple[type[Exception], type[Exception]]:
    """(UsageError, ClickException) of the click that Typer runs on: its own vendored copy since Typer 0.29,
    the click package before; `typer.BadParameter` derives from both in either case."""
    bases = typer.BadParameter.__mro__
    return (next(c for c in bases if c.__name__ == "UsageError"),
            next(c for c in bases if c.__name__ == "ClickException"))  # fmt: skip
