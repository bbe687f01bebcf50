"""`corpus` (the default source): the Python standard library's own source code, as bytes.

Real text that every machine with Python already has, so `moectl train configs/tiny.yaml` needs no
download. Exactly what it is:

  - every `*.py` file under `sysconfig.get_paths()["stdlib"]`, walking all sub-directories except
    `site-packages`, `dist-packages` (third-party code differs per machine), `__pycache__`, and test
    directories named `test`, `tests` or `idle_test` (distributions often ship them separately);
  - sorted by path relative to that directory, written with `/` separators (plain code-point order);
  - the raw file bytes (UTF-8 source) concatenated with no separator, cut at `MAX_BYTES` = 8 MiB
    (8,388,608 bytes; CPython 3.11 has about 12 MB of such files, so the cut falls near `pydoc_data/`);
  - tokenised at byte level: token id = byte value, vocab 256 (`model.vocab_size` must be >= 256).

It differs slightly between Python versions (and a distribution could patch a file), so a run logs its
size and sha256 (`TokenStream.meta()`); two machines with the same sha256 train on identical bytes.

The built stream is cached as `corpus-py<X.Y.Z>-<key>.bin` in `$MOECTL_CACHE_DIR`, else
`$XDG_CACHE_HOME/moectl`, else `~/.cache/moectl`. `<key>` hashes the file list with sizes and mtimes, so
an edited stdlib builds a new cache file. Writes are atomic (temp file + rename), so ranks building at the
same time are safe. A cached load is a stat walk plus a memory map (well under a second). When no cache
directory is writable the corpus is built in memory each time.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from moectl.core.errors import DataError

from ..storage import map_file
from ..stream import TokenStream

MAX_BYTES = 8 << 20
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> list[tuple[str, int, int]]:
    """`(relative posix path, size, mtime_ns)` of every corpus file under `root`, sorted by path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                full = os.path.join(dirpath, name)
                st = os.stat(full)
                found.append((Path(full).relative_to(root).as_posix(), st.st_size, st.st_mtime_ns))
    found.sort()
    return found


def default_cache_dir() -> Path:
    """`$MOECTL_CACHE_DIR`, else `$XDG_CACHE_HOME/moectl`, else `~/.cache/moectl`."""
    if os.environ.get("MOECTL_CACHE_DIR"):
        return Path(os.environ["MOECTL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moectl"


def _build_bytes(root: Path, files: list[tuple[str, int, int]], total: int) -> bytearray:
    out = bytearray()
    for rel, _, _ in files:
        if len(out) >= total:
            break
        out += (root / rel).read_bytes()
    del out[total:]
    return out


def build_corpus(
    *, cache_dir: str | Path | None = "default", max_bytes: int = MAX_BYTES, root: Path | None = None
) -> TokenStream:
    """Build (or load from cache) the stdlib corpus as a uint8 token stream.

    Args:
        cache_dir: where the built stream is cached; "default" = `default_cache_dir()`, None = no cache.
        max_bytes: cap on the corpus size (the documented default is 8 MiB; tests may pass less).
        root: the directory to read; defaults to this interpreter's stdlib.
    """
    root = root or stdlib_root()
    files = corpus_files(root)
    total = min(max_bytes, sum(size for _, size, _ in files))
    if total == 0:
        raise DataError(f"{root}: no .py files found for the corpus", "use another data.source, e.g. synthetic")
    key = hashlib.sha256(repr((max_bytes, files)).encode()).hexdigest()[:16]
    version = ".".join(map(str, sys.version_info[:3]))
    notes = {"python": version, "stdlib": str(root), "files": _files_used(files, total)}

    cache = default_cache_dir() if cache_dir == "default" else (Path(cache_dir) if cache_dir else None)
    if cache is not None:
        target = cache / f"corpus-py{version}-{key}.bin"
        if target.is_file() and target.stat().st_size == total:
            return _cached(target, notes)
    data = _build_bytes(root, files, total)
    if cache is not None and _write_atomic(target, data):
        return _cached(target, notes)
    return TokenStream(source="corpus", tokens=torch.frombuffer(data, dtype=torch.uint8), path=None, notes=notes)


def _cached(target: Path, notes: dict) -> TokenStream:
    return TokenStream(source="corpus", tokens=map_file(str(target), torch.uint8), path=str(target), notes=notes)


def _files_used(files: list[tuple[str, int, int]], total: int) -> int:
    used, seen = 0, 0
    for _, size, _ in files:
        if seen >= total:
            break
        used, seen = used + 1, seen + size
    return used


def _write_atomic(target: Path, data: bytearray) -> bool:
    """Write `data` to `target` via a temp file and rename; False when the cache is not writable."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return False  # a read-only home or full disk must not stop training: build in memory instead
    return True
