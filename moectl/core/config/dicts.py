"""A `Config` from plain data and back, checked: unknown keys get a did-you-mean, wrong types name key and value.

Unknown keys are errors with a did-you-mean (a typo must never silently become a default, torchtitan
#2386); a wrong type names the key, the value and the expected type. No YAML here: the engine and the
checkpoint format build configs from mappings they already hold (a checkpoint's manifest), so they never
load a YAML parser.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import asdict, fields, is_dataclass
from typing import Any, Iterable, Literal, Union

from moectl.core.config.schema import Config
from moectl.core.errors import ConfigError, ConfigErrors


def _suggest(name: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else "valid keys: " + ", ".join(sorted(options))


def type_name(tp: Any) -> str:
    """A schema type as a user reads it: `int`, `'adam' | 'muon' | 'sgd'`, `int | null`, `list[int]`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
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
    expected = type_name(tp)
    how = f"one of {expected}" if origin is Literal else f"a value of type {expected}"
    fix = f"set {key} to {how}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 and "int" in expected.split(" | "):
        # 1e3 is a float to YAML (and to moectl's loader): say so, rather than print 1000.0 against `int`
        fix = f"write {key} as the integer {int(value)} (a number in e-notation or with a point is a float)"
    raise ConfigError(key, value, f"expected {expected}", fix)


def _build(cls: type, data: Any, prefix: str, errors: list[ConfigError]) -> Any:
    """`cls` from `data`, every bad key or value appended to `errors` (the result is then meaningless)."""
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "the config"
        errors.append(ConfigError(where, data, "expected a mapping of keys", f"write {where} as 'key: value' lines"))
        return cls()
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in known:
            errors.append(ConfigError(path, value, "unknown key", _suggest(str(key), known),
                                      section=isinstance(value, dict) and not prefix))  # fmt: skip
            continue
        tp = hints[key]
        if is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, f"{path}.", errors)
            continue
        try:
            kwargs[key] = _coerce(path, value, tp)
        except ConfigError as e:
            errors.append(e)
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and type-check a `Config` from a raw mapping; every bad key and value is reported at once (one
    `ConfigError`, or `ConfigErrors` holding each), so a file with three typos takes one round trip."""
    errors: list[ConfigError] = []
    cfg = _build(Config, data, "", errors)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The fully resolved config as plain data."""
    return asdict(cfg)
