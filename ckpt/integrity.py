"""`verify_checkpoint`: everything wrong with a checkpoint folder, each problem naming file and tensor.

Checks, without executing or unpickling anything:
- the commit marker: a `.tmp-` folder or a missing manifest.json means the save never finished;
- the manifest: JSON, format version, schema, step vs folder name (`ckpt.manifest.check`), and its own
  digest over every field (`ckpt.seal`: an edited run state is refused like an edited tensor);
- every listed file: present, size, safetensors header (`ckpt.st_header`), the tensors in it vs the
  manifest (names, dtype, shape), the file's digest; each changed tensor is named by its own sha256
  (Megatron's `integrity.json` can only name the file);
- no unlisted files: a stray `.pt`/pickle beside the shards is reported (and never opened beyond its
  first bytes, to say what it looks like).

Format 3 files (`ckpt.digest`: a tree over the header's and the tensors' sha256s) are verified in one pass:
the header and every tensor of every file are hashed side by side on `ckpt.shard_io.io_threads()` threads,
largest first, and the same hashes give the file's digest and name any changed tensor. Format 1-2 files
recorded the whole file's sha256, one sequential pass per file: files are then hashed side by side, and
tensors only when their file does not match. Each hash reads large chunks while it hashes the previous one
(`ckpt.shard_io.hash_file`), so verifying is as fast as the disk reads or the cores hash, whichever is
slower, not their sum.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from ckpt import manifest, names
from ckpt import problems as P
from ckpt.digest import uses_tree
from ckpt.discovery import TOOL_ADVICE, checkpoint_folder, denied, is_step_dir, resolve_load_path
from ckpt.problems import Problem
from ckpt.seal import seal_problem
from ckpt.shard_io import hash_file, io_threads, range_jobs
from ckpt.st_header import TORCH_NAME, Header, read_header
from ckpt.verify_tree import hash_jobs, pieces, tree_problems

_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt", ".distcp")


def verify_checkpoint(path: str | os.PathLike[str]) -> list[Problem]:
    """All problems of the checkpoint at `path` (empty list: it is intact).

    `path` is a step folder (committed or not, so an interrupted save can be inspected) or a checkpoints
    folder (then the step `latest` names). Raises CheckpointArgumentError (exit 2) if `path` is neither (a file,
    a run folder, a Hugging Face model folder, ...), or this user may not read the folders that say which it is
    (`ckpt.discovery.unreadable`) or a file in the step folder (`ckpt.discovery.denied`: the checkpoint may be
    fine, so it is no problem of it); a CheckpointError (exit 1) for a checkpoints folder that names no committed
    step (`ckpt.discovery.resolve_load_path`).
    """
    p = checkpoint_folder(path, TOOL_ADVICE)  # missing or a file: worded as every other command words it
    step_dir = p if is_step_dir(p) else resolve_load_path(p, TOOL_ADVICE)
    found = _step_problems(step_dir)
    refused = denied(step_dir, found)
    if refused is not None:
        raise refused
    return found


def _step_problems(step_dir: Path) -> list[Problem]:
    """Everything wrong with the step folder `step_dir`, a file this user may not read included."""
    found: list[Problem] = []
    if names.TMP_DIR_RE.match(step_dir.name):
        found.append(Problem(P.INCOMPLETE, None, None, f"{step_dir.name} is an unfinished save (never committed)"))
    m, mprobs = manifest.load(step_dir)
    found += mprobs
    listed: dict[str, Any] = m["files"] if m else {}
    found += _unexpected_files(step_dir, listed, manifest_ok=m is not None)
    if m is None:
        return found
    by_file: dict[str, dict[str, Any]] = {f: {} for f in listed}
    for tname, rec in m["tensors"].items():
        by_file[rec["file"]][tname] = rec
    if uses_tree(m):
        found += _check_tree_files(step_dir, listed, by_file)
    else:
        jobs = [(step_dir, f, rec, by_file[f]) for f, rec in listed.items()]
        for probs in _in_parallel(_check_one, jobs):
            found += probs
    # Last, so that a problem naming a file or tensor comes first when an edit touched both.
    edited = seal_problem(m)
    if edited:
        found.append(Problem(P.MANIFEST, names.MANIFEST, None, edited))
    return found


def quick_problem(step_dir: Path) -> str | None:
    """The first problem a glance finds in a committed step folder, or None: the manifest reads and checks,
    and every file it lists is there at its recorded size. No hashing (milliseconds, for advice: a truncated
    or missing shard shows; a flipped byte needs `verify_checkpoint`)."""
    m, problems = manifest.load(step_dir)
    if m is None or problems:
        return problems[0].message if problems else "its manifest cannot be used"
    for fname, frec in m["files"].items():
        path = step_dir / fname
        if not path.is_file():
            return f"{fname} is missing"
        wrong_size = _wrong_size(path, frec)
        if wrong_size is not None:
            return f"{fname} {wrong_size}"
    return None


def _wrong_size(path: Path, frec: dict[str, Any]) -> str | None:
    """How a listed file's size differs from its manifest record ("is N bytes, the manifest says M"), or None."""
    size = path.stat().st_size
    return None if size == frec["size"] else f"is {size} bytes, the manifest says {frec['size']}"


class BackgroundVerify:
    """`verify_checkpoint(path)` on a thread of its own, for a reader that goes ahead meanwhile (a convert, a
    validate) and must ask `problems()` before it trusts, or lets anyone else trust, what it read. The reader's
    reads then come from the pages the verification brought into the page cache, or bring them in for it:
    the files are read from disk about once, and hashing overlaps the reader's own work."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self._problems: list[Problem] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="moectl-ckpt-verify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._problems = verify_checkpoint(self.path)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread by problems()
            self._error = e

    def problems(self) -> list[Problem]:
        """Wait for the verification; its problems (raises what `verify_checkpoint` raised)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._problems is not None
        return self._problems


def _check_one(step_dir: Path, fname: str, frec: dict[str, Any], expected: dict[str, Any]) -> list[Problem]:
    try:
        return _check_file(step_dir / fname, frec, expected)
    except OSError as e:
        return [P.unreadable(fname, e)]


def _in_parallel(fn: Callable[..., list[Problem]], args: list[tuple[Any, ...]]) -> list[list[Problem]]:
    """`fn(*a)` for each `a`, files hashed side by side (each hash is one core's sequential pass); in order."""
    workers = min(len(args), io_threads())
    if workers <= 1:
        return [fn(*a) for a in args]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moectl-ckpt-verify") as pool:
        return list(pool.map(lambda a: fn(*a), args))


def _unexpected_files(step_dir: Path, listed: dict[str, Any], manifest_ok: bool) -> list[Problem]:
    out = []
    try:
        entries = sorted(step_dir.iterdir())
    except OSError as e:  # enterable but not listable: its stray files cannot be looked for
        return [P.unreadable(None, e, "the folder cannot be listed")]
    for entry in entries:
        name = entry.name
        if name == names.MANIFEST or name in listed:
            continue
        if not manifest_ok and names.SHARD_RE.match(name):
            continue  # no manifest to compare with; already reported as incomplete/unreadable
        if _looks_pickled(entry):
            out.append(Problem(P.UNEXPECTED_FILE, name, None,
                               "looks like a pickle/torch.save file, not part of the checkpoint: never loaded; delete it"))  # fmt: skip
        else:
            kind = "folder" if entry.is_dir() else "file"
            out.append(Problem(P.UNEXPECTED_FILE, name, None, f"unexpected {kind}: the manifest does not list it"))
    return out


def _looks_pickled(entry: Path) -> bool:
    """By name or by magic bytes (pickle protocol 2+ starts 0x80; torch.save's zip starts 'PK')."""
    if entry.suffix in _PICKLE_SUFFIXES:
        return True
    if not entry.is_file():  # never open a FIFO or device: reading it could block
        return False
    try:
        with open(entry, "rb") as f:
            head = f.read(2)
    except OSError:
        return False
    return head[:1] == b"\x80" or head == b"PK"


def _check_structure(path: Path, frec: dict[str, Any], expected: dict[str, Any]
                     ) -> tuple[list[Problem], Header | None, bool]:  # fmt: skip
    """Everything of one listed shard file short of hashing it: (problems, its header if usable, whether its
    bytes can be hashed: present at the recorded size). `expected` = the manifest's tensors in it."""
    fname = path.name
    if not path.is_file():
        held = ", ".join(sorted(expected)[:3]) + (", ..." if len(expected) > 3 else "")
        return [Problem(P.MISSING_FILE, fname, None, f"missing; it held {len(expected)} tensor(s): {held}")], None, False
    found = []
    wrong_size = _wrong_size(path, frec)
    size_ok = wrong_size is None
    if not size_ok:
        found.append(Problem(P.SIZE, fname, None, wrong_size))
    header, hprobs = read_header(path)
    found += hprobs
    if header is None and _looks_pickled(path):
        # Only a hint for the user: the header check above already refused it. (The magic bytes alone
        # prove nothing: a valid header length can start with 0x80.) Nothing here unpickles it.
        found.append(Problem(P.UNEXPECTED_FILE, fname, None, "looks like a pickle/torch.save payload: never loaded"))
    if header is not None:
        found += _check_tensor_set(fname, header, expected)
    return found, (header if not hprobs else None), size_ok


def _check_tree_files(step_dir: Path, listed: dict[str, Any], by_file: dict[str, dict[str, Any]]) -> list[Problem]:
    """Format 3: every listed file checked, its header and tensors hashed in one pool across all files."""
    checked: dict[str, tuple[list[Problem], Header | None, bool]] = {}
    jobs: list[tuple[str, list[tuple[int, int]]]] = []
    for fname, frec in listed.items():
        try:
            checked[fname] = _check_structure(step_dir / fname, frec, by_file[fname])
        except OSError as e:
            checked[fname] = ([P.unreadable(fname, e)], None, False)
            continue
        _, header, hashable = checked[fname]
        if hashable and header is not None:
            jobs += [(fname, group) for group in range_jobs(pieces(header))]
    hashed, failed = hash_jobs(step_dir, jobs)
    found: list[Problem] = []
    for fname, (probs, header, hashable) in checked.items():
        found += probs
        if fname in failed:
            found.append(failed[fname])
        elif hashable and header is None:  # the saved header always parses: this one was changed
            found.append(Problem(P.SHA256, fname, None, "differs from the saved file: its header no longer parses "
                                                        "as written, so its tensors' bytes cannot be told apart"))  # fmt: skip
        elif hashable and header is not None:
            found += tree_problems(fname, header, hashed, listed[fname], by_file[fname])
    return found


def _check_file(path: Path, frec: dict[str, Any], expected: dict[str, Any]) -> list[Problem]:
    """Format 1-2: problems of one listed shard file, its whole-file sha256 included."""
    fname = path.name
    found, header, size_ok = _check_structure(path, frec, expected)
    if size_ok and _sha256(path) != frec["sha256"]:
        changed = _changed_tensors(path, header, expected) if header is not None else None
        if changed:
            found += [Problem(P.SHA256, fname, t, "bytes differ from the saved ones (sha256 mismatch)") for t in changed]
        elif changed == []:
            found.append(Problem(P.SHA256, fname, None,
                                 "sha256 differs from the manifest although every tensor's bytes match: "
                                 "the file's header or the manifest was changed"))  # fmt: skip
        else:
            found.append(Problem(P.SHA256, fname, None, "sha256 differs from the manifest"))
    return found


def _check_tensor_set(fname: str, header: Header, expected: dict[str, Any]) -> list[Problem]:
    out = []
    for t in sorted(set(expected) - set(header.entries) - header.malformed):
        out.append(Problem(P.TENSOR_SET, fname, t, "listed in the manifest but not in the file"))
    for t in sorted((set(header.entries) | header.malformed) - set(expected)):
        out.append(Problem(P.TENSOR_SET, fname, t, "in the file but not listed in the manifest"))
    for t in sorted(set(header.entries) & set(expected)):
        e, rec = header.entries[t], expected[t]
        got = (TORCH_NAME.get(e.dtype, e.dtype), list(e.shape))
        want = (rec["dtype"], rec["shape"])
        if got != want:
            out.append(Problem(P.TENSOR_SET, fname, t, f"file has {got[0]}{got[1]}, the manifest says {want[0]}{want[1]}"))
    return out


def _sha256(path: Path) -> str:
    return hash_file(path)


def _changed_tensors(path: Path, header: Header, expected: dict[str, Any]) -> list[str]:
    """The tensors whose bytes no longer hash to their manifest sha256 (header assumed sane)."""
    return [t for t in sorted(set(expected) & set(header.entries))
            if hash_file(path, header.entries[t].start, header.entries[t].end) != expected[t]["sha256"]]  # fmt: skip
