"""The layering of docs/architecture.md, checked on the source: imports run one way, packages form no cycle,
the engine and the checkpoint format never load the face's libraries, and the base never loads torch.

Imports are read statically (ast), function-local ones included, so a lazy import cannot hide an arrow.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("moectl", "trainer", "ckpt")

# Layers from the bottom up; a module may import its own layer and the ones below it, never above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("moectl.core", "moectl"),  # torch-free base (the root package holds only the version)
    ("ckpt",),  # the checkpoint format
    ("trainer",),  # the engine
    ("moectl.bench",),  # benchmarks over the engine's public API
    ("moectl.cli", "moectl.__main__"),  # the face
)


def _modules() -> dict[str, Path]:
    mods = {}
    for top in PACKAGES:
        for f in (REPO / top).rglob("*.py"):
            parts = list(f.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


MODULES = _modules()


def _resolve(name: str) -> str:
    """The longest prefix of `name` that is one of our modules (`from a.b import c` may name a symbol)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(module: str) -> set[str]:
    """Every module of ours that `module` imports, at any depth of its code."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names]
        found.update(_resolve(n) for n in names if n.split(".")[0] in PACKAGES)
    return found - {module}


def layer_of(module: str) -> int:
    best, depth = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    assert best >= 0, f"{module} is in no layer: add it to LAYERS"
    return best


def unit_of(module: str) -> str:
    """The package a cycle check is about: `trainer.moe`, `ckpt`, `moectl.core`, `trainer.loop`, ..."""
    parts = module.split(".")
    if parts[0] == "ckpt":
        return "ckpt"
    depth = 3 if parts[0] == "moectl" and len(parts) > 1 and parts[1] == "core" else 2
    return ".".join(parts[:depth])


def test_imports_only_run_down_the_layers() -> None:
    upward = [
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m in sorted(MODULES)
        for t in sorted(imports_of(m))
        if layer_of(t) > layer_of(m)
    ]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_cycle_between_packages() -> None:
    edges: dict[str, set[str]] = {}
    for m in MODULES:
        for t in imports_of(m):
            a, b = unit_of(m), unit_of(t)
            if a != b:
                edges.setdefault(a, set()).add(b)
    assert _cycles(edges) == []


def test_cycle_finder_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    """A planted `trainer -> moectl.cli` import is reported (the check is not vacuous)."""
    planted = "trainer._planted_upward"
    MODULES[planted] = tmp_path / "planted.py"
    MODULES[planted].write_text("def f():\n    from moectl.cli.progress import RichObserver\n")
    try:
        assert any(layer_of(t) > layer_of(planted) for t in imports_of(planted))
    finally:
        del MODULES[planted]


def test_the_base_never_imports_torch_or_the_face() -> None:
    bad = [
        f"{m}: {node}"
        for m, path in MODULES.items()
        if layer_of(m) == 0
        for node in _third_party(path)
        if node.split(".")[0] in {"torch", "rich", "typer", "triton", "safetensors"}
    ]
    assert not bad


def _third_party(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return names


def test_engine_and_format_import_without_the_face_libraries() -> None:
    """Importing every module of trainer/ and ckpt/ (Triton-only kernels excepted off CUDA) loads no Rich,
    Typer or YAML parser: those belong to the CLI face and the config loader."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import trainer, ckpt\n"
        "assert not {'rich', 'typer', 'yaml'} & set(sys.modules), 'import trainer, ckpt'\n"
        "for pkg in (trainer, ckpt):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        try:\n"
        "            importlib.import_module(m.name)\n"
        "        except ModuleNotFoundError as e:\n"
        "            if e.name != 'triton':\n"
        "                raise\n"
        "        loaded = {'rich', 'typer', 'yaml'} & set(sys.modules)\n"
        "        assert not loaded, f'{m.name} loaded {loaded}'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("module", ["trainer", "ckpt", "moectl.core", "moectl.bench", "moectl.cli"])
def test_every_layer_has_modules(module: str) -> None:
    assert any(m == module or m.startswith(module + ".") for m in MODULES)
