"""Every config key with its type, default and docstring: what `moectl config keys` lists.

Read from the schema itself (moectl/core/config/schema.py), so the list can never drift from what the
loader accepts. Keys are dotted as `--set` takes them (`optimizer.lr`), in schema order.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any

from moectl.core.config.dicts import type_name
from moectl.core.config.schema import Config


@dataclass(frozen=True)
class KeyInfo:
    """One key: dotted name, type as a user writes it, default (plain data), docstring."""

    key: str
    type: str
    default: Any
    help: str


def _default(f: Any) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def config_keys(cls: type = Config, prefix: str = "") -> list[KeyInfo]:
    """Every leaf key of `cls` (a config dataclass), sections flattened into dotted names."""
    hints = typing.get_type_hints(cls)
    out: list[KeyInfo] = []
    for f in fields(cls):
        tp = hints[f.name]
        if is_dataclass(tp):
            out += config_keys(tp, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        else:
            out.append(KeyInfo(f"{prefix}{f.name}", type_name(tp), _default(f), f.metadata.get("help", "")))
    return out
