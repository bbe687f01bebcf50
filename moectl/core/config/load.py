"""Reading a config: YAML file + dotted `--set` overrides -> a checked `Config` (the checks: `dicts.py`).

Values of `--set` are parsed as YAML scalars, so `--set moe.glu_interleave_size=null` and
`--set optimizer.lr=3e-4` do what they say. The only module of the base that imports PyYAML.

Two things PyYAML accepts are refused here, each in one line: a key given twice in one mapping (a second
`moe:` section silently replaced the first, issue 18; the error names both lines), and a file that is not
UTF-8 (it was a traceback; the error names the line and the byte).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from moectl.core.config.dicts import config_from_dict
from moectl.core.config.dump import dump_config  # noqa: F401 - the loader's inverse, re-exported
from moectl.core.config.schema import Config
from moectl.core.environment import says_it_once
from moectl.core.errors import UsageError


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that names one key twice: `key`, and the 1-based lines of the first and the second."""

    def __init__(self, key: str, first_line: int, second_line: int) -> None:
        super().__init__(f"key {key!r} appears twice")
        self.key, self.first_line, self.second_line = key, first_line, second_line


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `3e-4` as a float (YAML 1.2), as every user writing a learning rate expects,
    and refuses a key given twice in one mapping (PyYAML keeps the last one without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue  # `<<: *base` overrides on purpose
            line = key_node.start_mark.line + 1
            if key_node.value in seen:
                raise DuplicateKeyError(key_node.value, seen[key_node.value], line)
            seen[key_node.value] = line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$|^[-+]?[0-9][0-9_]*\.[0-9_]*$|^[-+]?\.[0-9_]+$"),
    list("-+0123456789."),
)


def yaml_scalar(raw: str) -> Any:
    """Parse one YAML value with moectl's loader."""
    return yaml.load(raw, Loader=_Loader)


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split one `--set KEY=VALUE` into its dotted key path and its YAML-scalar value."""
    if "=" not in item:
        raise UsageError(f"--set {item!r}: expected KEY=VALUE", "write it as --set section.key=value")
    key, raw = item.split("=", 1)
    if not all(part.strip() for part in key.split(".")):
        raise UsageError(f"--set {item!r}: no key before '=' (or an empty part in it)",
                         "write it as --set section.key=value")  # fmt: skip
    try:
        value = yaml_scalar(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise UsageError(f"--set {item!r}: value is not a YAML scalar ({e.__class__.__name__})", "quote the value") from None
    if isinstance(value, dict):
        raise UsageError(f"--set {item!r}: value must be a scalar or a list", "set one key at a time")
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply `--set` overrides to the raw YAML mapping (unknown keys are caught by the typed build)."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UsageError(f"--set {item!r}: {part} is not a section", "check the key path")
            node = child
        node[path[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a mapping; an empty file is an empty mapping."""
    p = Path(path)
    if not p.is_file():
        if p.is_dir():
            what = "is a folder, not a YAML file"
        elif p.exists():  # /dev/null, a fifo, a socket
            what = "is not a regular file"
        elif p.is_symlink():
            what = "is a symbolic link that leads nowhere (broken, or a loop)"
        else:
            what = "not found"
        raise UsageError(f"config file {str(p)!r} {what}", "pass the path of a YAML config, e.g. configs/tiny.yaml")
    try:
        data = yaml.load(_read_utf8(p), Loader=_Loader)
    except DuplicateKeyError as e:
        raise UsageError(
            f"{p}: key {e.key!r} appears twice (lines {e.first_line} and {e.second_line}); the second would "
            "silently replace the first",
            "merge the two into one",
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise UsageError(f"{p}: not valid YAML{where}: {problem}", "fix the YAML syntax there") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{p}: the top level must be a mapping of sections", "start with 'model:', 'moe:', ...")
    return data


def _read_utf8(p: Path) -> str:
    """The file's text, or a one-line UsageError naming the line and byte that are not UTF-8."""
    raw = p.read_bytes()
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark, as some editors write one, is not an error
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise UsageError(
            f"{p}: not UTF-8 text: byte 0x{raw[e.start]:02x} at line {line}, column {column}",
            "save the file as UTF-8",
        ) from None


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> Config:
    """Load a config file (or the defaults when `path` is None) and apply `--set` overrides."""
    data = read_yaml(path) if path is not None else {}
    if path is not None and not data and _first_notice(str(path)):  # likely the wrong file: all defaults
        warnings.warn(f"config file {str(path)!r} is empty: every key takes its default (moectl config keys "
                      "lists them)", UserWarning, stacklevel=2)  # fmt: skip
    return config_from_dict(apply_overrides(data, overrides))


_NOTICED: set[str] = set()


def _first_notice(path: str) -> bool:
    """Whether to warn about the empty file `path`: once per process (a command may load its config twice), and
    not in a launched worker or a rank other than 0 (the launcher or rank 0 says it)."""
    if path in _NOTICED or not says_it_once(os.environ):
        return False
    _NOTICED.add(path)
    return True


def overridden(overrides: Iterable[str]) -> Callable[[dict[str, Any]], Config]:
    """A function that builds a `Config` from raw data (a checkpoint's stored config) with `--set` applied.

    The overrides' syntax, keys and types are checked here, against the defaults, before any checkpoint is read:
    a mistyped `--set` is the command's error (a UsageError or ConfigError, exit 2), not a failed restore of a
    checkpoint that may be fine (`ckpt validate` reported it as "invalid", exit 1)."""
    items = list(overrides)
    config_from_dict(apply_overrides({}, items))
    return lambda data: config_from_dict(apply_overrides(data, items))
