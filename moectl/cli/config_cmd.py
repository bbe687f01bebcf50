"""`moectl config keys`: every config key with its type, default and docstring (a table, or --json).

There was no way from the CLI to list the keys (issue 18); the schema's docstrings were only in the source.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from moectl.cli.base import app, command, new_app
from moectl.cli.console import make_console
from moectl.cli.options import JsonFlag, examples

config_app = new_app("config", "Look up the config schema: every key, its type, default and meaning.")
app.add_typer(config_app, name="config")


def _yaml_value(v: object) -> str:
    """A default as it is written in YAML (null, true, 3e-3, [1, 0])."""
    return json.dumps(v) if not isinstance(v, str) else v


@command(
    config_app,
    name="keys",
    help="List every config key (dotted, as --set takes it) with its type, default and docstring."
    + examples("moectl config keys", "moectl config keys optimizer", "moectl config keys --json"),
)
def keys_command(
    section: Annotated[Optional[str], typer.Argument(help="Only keys starting with this (e.g. optimizer).")] = None,
    json_: JsonFlag = False,
) -> None:
    from moectl.core.config.keys import config_keys
    from moectl.core.errors import UsageError

    keys = [k for k in config_keys() if section is None or k.key.startswith(section)]  # a section, key or prefix
    if not keys:
        sections = sorted({k.key.split(".")[0] for k in config_keys()})
        close = difflib.get_close_matches(section or "", sections + [k.key for k in config_keys()], n=1, cutoff=0.7)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(f"no config key starts with {section!r}", f"{hint}use one of {', '.join(sections)}")
    if json_:
        typer.echo(json.dumps([asdict(k) for k in keys], indent=2))
        return
    table = Table(show_lines=False)
    for name in ("key", "type", "default", "meaning"):
        table.add_column(name, overflow="fold")
    for k in keys:
        # escaped: help texts hold brackets (`[gate; up]`, `[m, m]`) that Rich would read as markup and drop
        table.add_row(*(escape(v) for v in (k.key, k.type, _yaml_value(k.default), k.help)))
    make_console().print(table)
