"""Reading a config: YAML file + dotted `--set` overrides -> a checked `Config`.

Unknown keys are errors with a did-you-mean (a typo must never silently become a default, torchtitan
#2386); a wrong type names the key, the value and the expected type. Values of `--set` are parsed as
YAML scalars, so `--set moe.glu_interleave_size=null` and `--set optimizer.lr=3e-4` do what they say.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Union

import yaml

from moectl.config.schema import Config
from moectl.errors import ConfigError, UsageError


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `3e-4` as a float (YAML 1.2), as every user writing a learning rate expects."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$|^[-+]?[0-9][0-9_]*\.[0-9_]*$|^[-+]?\.[0-9_]+$"),
    list("-+0123456789."),
)


def yaml_scalar(raw: str) -> Any:
    """Parse one YAML value with moectl's loader."""
    return yaml.load(raw, Loader=_Loader)


def _suggest(name: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else "valid keys: " + ", ".join(sorted(options))


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against `tp`; return it (ints widen to float). Raise ConfigError otherwise."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                continue
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, list):
            return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a schema bug, not a user error
        raise TypeError(f"unsupported config type {tp!r} for {key}")
    expected = _type_name(tp)
    how = f"one of {expected}" if origin is Literal else f"a value of type {expected}"
    raise ConfigError(key, value, f"expected {expected}", f"set {key} to {how}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "the config"
        raise ConfigError(where, data, "expected a mapping of keys", f"write {where} as 'key: value' lines")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(path, value, "unknown key", _suggest(str(key), known))
        tp = hints[key]
        if is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, f"{path}.")
        else:
            kwargs[key] = _coerce(path, value, tp)
    return cls(**kwargs)


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split one `--set KEY=VALUE` into its dotted key path and its YAML-scalar value."""
    if "=" not in item:
        raise UsageError(f"--set {item!r}: expected KEY=VALUE", "write it as --set section.key=value")
    key, raw = item.split("=", 1)
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
        raise UsageError(f"config file {str(p)!r} not found", "pass the path of a YAML config, e.g. configs/tiny.yaml")
    try:
        data = yaml.load(p.read_text(), Loader=_Loader)
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


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and type-check a `Config` from a raw mapping."""
    return _build(Config, data, "")


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> Config:
    """Load a config file (or the defaults when `path` is None) and apply `--set` overrides."""
    data = read_yaml(path) if path is not None else {}
    return config_from_dict(apply_overrides(data, overrides))


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The fully resolved config as plain data."""
    return asdict(cfg)


def dump_config(cfg: Config) -> str:
    """The fully resolved config as YAML (what `train` writes into run_dir/config.yaml)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None)
