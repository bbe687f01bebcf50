"""No config key is accepted and ignored: every schema key is read by code outside the schema and the rules.

A static check over the source (ast): a key counts as read where some module outside
`moectl/core/config/` (loading, dumping), `moectl/core/rules.py` (validating a key is not using it) and
`moectl/core/summary.py` (printing it neither) reads an attribute of that name, or reads a property or
method of the key's section that reads it (`ModelConfig.kv_heads` reads `num_query_groups`). Attribute
names are not typed, so a key could pass on a same-named attribute of something else; the check is for the
silent no-op (`moe.delay_wgrad_compute` was one until issue 20), which it catches: see the planted key.
"""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

from moectl.core.config.schema import SECTIONS, Config

REPO = Path(__file__).resolve().parents[3]
SCHEMA = REPO / "moectl" / "core" / "config" / "schema.py"
NOT_A_READ = ("moectl/core/config/", "moectl/core/rules.py", "moectl/core/summary.py")


def attributes_read() -> set[str]:
    """Every attribute name read anywhere in moectl/, trainer/ and ckpt/ outside `NOT_A_READ`."""
    names: set[str] = set()
    for top in ("moectl", "trainer", "ckpt"):
        for f in (REPO / top).rglob("*.py"):
            if str(f.relative_to(REPO)).startswith(NOT_A_READ):
                continue
            names.update(n.attr for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Attribute))
    return names


def schema_accessors() -> dict[str, dict[str, set[str]]]:
    """Per section class name: key -> the class's properties and methods that read `self.<key>`."""
    out: dict[str, dict[str, set[str]]] = {}
    for cls in ast.walk(ast.parse(SCHEMA.read_text())):
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef):
                for n in ast.walk(fn):
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                        out.setdefault(cls.name, {}).setdefault(n.attr, set()).add(fn.name)
    return out


def unread(keys: dict[str, list[str]], read: set[str]) -> list[str]:
    """`section.key` of the keys (by section class name) that nothing outside reads, directly or through an
    accessor of its section."""
    accessors = schema_accessors()
    missing = []
    for cls_name, names in keys.items():
        for key in names:
            via = accessors.get(cls_name, {}).get(key, set())
            if key not in read and not (via & read):
                missing.append(f"{cls_name}.{key}")
    return missing


def schema_keys() -> dict[str, list[str]]:
    keys = {cls.__name__: [f.name for f in fields(cls)] for cls in SECTIONS.values()}
    keys["Config"] = [f.name for f in fields(Config) if f.name not in SECTIONS]  # run_dir
    return keys


def test_every_schema_key_is_read_outside_the_schema_and_the_rules() -> None:
    keys = schema_keys()
    assert sum(len(v) for v in keys.values()) > 80
    assert unread(keys, attributes_read()) == []


def test_the_check_sees_an_unread_key() -> None:
    """A planted key is reported, and so is a real one once its readers are taken away."""
    read = attributes_read()
    assert unread({"MoEConfig": ["planted_never_read_key"]}, read) == ["MoEConfig.planted_never_read_key"]
    assert unread({"MoEConfig": ["delay_wgrad_compute"]}, read - {"delay_wgrad_compute"}) == [
        "MoEConfig.delay_wgrad_compute"
    ]
    # a key read only through its section's property counts as read (num_query_groups via kv_heads)
    assert unread({"ModelConfig": ["num_query_groups"]}, read - {"num_query_groups"}) == []
    assert unread({"ModelConfig": ["num_query_groups"]}, read - {"num_query_groups", "kv_heads"}) != []
