"""Which checkpoint to load: committed steps, the `latest` pointer, and `checkpoint.load` paths.

A step is committed when its folder is named exactly `step_<8 digits>` and holds a valid manifest.json
(torchtitan likewise counts `step-N` only if its `.metadata` exists). In-flight (`.tmp-`), half-deleted
(`.trash-`) and manifest-less folders are never candidates. `latest` is trusted as Megatron trusts its
tracker file (it is written only after the commit), but if it names a step that is not there the error
says so instead of silently taking another one. The one step taken over it is the one a pending `latest`
(`latest.tmp-<nonce>`) names, committed and newer: a save killed between its rename and moving `latest`
leaves that file (ckpt/save.py), and the step it names is committed. A load path that does not exist is
an error, never a silent fresh start (Megatron's `exit_on_missing_checkpoint`). Nor is one this user may
not read: that is `unreadable`'s one line, naming the folder or file and the OS's reason, never a traceback;
a file inside a step folder that this user may not read is the same error (`denied`), not a bad checkpoint.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ckpt import manifest, names
from ckpt import problems as P
from ckpt.problems import Problem
from moectl.core.errors import CheckpointArgumentError, CheckpointError

_READ_FIX = "make it readable by this user (e.g. chmod -R u+rX on it), or load another checkpoint"


@dataclass(frozen=True)
class Advice:
    """How the user of a command gives it a checkpoint, for the fixes of the errors about the one given:
    `train`'s user sets `checkpoint.load`, the checkpoint tools' (`moectl ckpt ...`) pass a PATH argument.
    The errors themselves are worded once, here; only the advice differs by command."""

    fix: str  #: the fix of a path that names nothing usable
    use: str  #: how to give another one, `{}` standing for it

    def to_use(self, what: str) -> str:
        """The advice to give `what` instead (a path, or a description of one)."""
        return self.use.format(what)


#: the trainer's (the default): what to set checkpoint.load to
LOAD_ADVICE = Advice(
    "set checkpoint.load to a step_NNNNNNNN folder or a checkpoints folder, or to null to train from scratch",
    "point checkpoint.load at {}",
)
#: the checkpoint tools' (`moectl ckpt ...`), which have no checkpoint.load to set: what to pass them
TOOL_ADVICE = Advice("give a step_NNNNNNNN folder or a checkpoints folder (e.g. runs/tiny/checkpoints)", "pass {}")


def unreadable(path: Path, e: OSError, fix: Optional[str] = None) -> CheckpointArgumentError:
    """The error for a checkpoint folder or file the OS will not let this user read (exit 2, like a path that does
    not exist: the checkpoint may be fine, so `ckpt validate` must not call it invalid)."""
    return CheckpointArgumentError(f"{path} cannot be read: {e.strerror or e}", fix or _READ_FIX)


def denied(step_dir: Path, problems: list[Problem]) -> Optional[CheckpointArgumentError]:
    """`unreadable`'s error for the first of `problems` (found in `step_dir`) that is the OS refusing this user
    (`Problem.denied`), else None. A file of the step that this user may not read is the command's fault as its
    folder is (exit 2, fixed by a chmod): it was a bad checkpoint (exit 1, `ckpt validate` "invalid") whose fix
    sent the user to load another step, which the same permissions would refuse too."""
    for p in problems:
        if p.denied:
            path = step_dir / p.file if p.file else step_dir
            return CheckpointArgumentError(f"{path} {p.message.removeprefix('the folder ')}", _READ_FIX)
    return None


def stat_or_none(path: Path) -> Optional[os.stat_result]:
    """`path`'s stat, None when there is nothing there; a folder on the way this user may not enter is `unreadable`
    (naming that folder), never a traceback nor a silent "not there"."""
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:  # stat needs no permission on `path` itself: EACCES is about a folder on the way
        raise unreadable(_blocking_folder(path) if e.errno == errno.EACCES else path, e) from None


def _blocking_folder(path: Path) -> Path:
    """The outermost folder on the way to `path` that this user may not enter (the one a chmod must fix: naming
    the innermost sent the user to a folder that was fine), else `path`'s own folder."""
    for folder in reversed(path.parents):  # outermost first, as the path was given
        if str(folder) not in ("", ".") and not os.access(folder, os.X_OK):
            return folder
    return path.parent


def _is_file(path: Path) -> bool:
    """`path.is_file()`, with `stat_or_none`'s error for a folder on the way this user may not enter."""
    st = stat_or_none(path)
    return st is not None and stat.S_ISREG(st.st_mode)


def _is_dir(path: Path) -> bool:
    """`path.is_dir()`, with `stat_or_none`'s error for a folder on the way this user may not enter."""
    st = stat_or_none(path)
    return st is not None and stat.S_ISDIR(st.st_mode)


def _entries(root: Path) -> list[Path]:
    """The entries of folder `root`, or `unreadable` when this user may not list it."""
    try:
        return list(root.iterdir())
    except OSError as e:
        raise unreadable(root, e) from None


def list_committed(root: str | os.PathLike[str]) -> list[Path]:
    """The committed step folders under `root`, oldest first (empty if `root` does not exist)."""
    root = Path(root)
    if not _is_dir(root):
        return []
    found = []
    for p in _entries(root):
        step = names.parse_step_dir(p.name)
        if step is not None and _is_dir(p) and manifest.load(p)[0] is not None:
            found.append((step, p))
    return [p for _, p in sorted(found)]


def list_uncommitted(root: str | os.PathLike[str]) -> list[Path]:
    """Folders under `root` that look like checkpoints but are not committed (interrupted saves etc.).

    Nothing deletes these automatically: a user (or a future `moectl ckpt` command) may, once sure no
    save is running.
    """
    root = Path(root)
    if not _is_dir(root):
        return []
    out = []
    for p in sorted(_entries(root)):
        if not _is_dir(p):
            continue
        if names.TMP_DIR_RE.match(p.name) or names.TRASH_DIR_RE.match(p.name):
            out.append(p)
        elif names.parse_step_dir(p.name) is not None and manifest.load(p)[0] is None:
            out.append(p)
    return out


def read_latest(root: str | os.PathLike[str]) -> str | None:
    """The folder name `root/latest` holds, or None if there is no `latest` (error if it is garbled)."""
    path = Path(root) / names.LATEST
    if not _is_file(path):
        return None
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError as e:
        raise unreadable(path, e, "make it readable by this user (chmod u+r), or delete it to fall back on the newest "
                                  "committed step") from None  # fmt: skip
    if names.parse_step_dir(text) is None:
        raise CheckpointError(
            f"{path} holds {text[:40]!r}, not a step_NNNNNNNN folder name",
            "write the newest good step's folder name into it, or delete it to fall back on the newest committed step",
        )
    return text


def pending_latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest committed step folder a pending `latest` under `root` names (`latest.tmp-<nonce>`, left by a
    save killed between its rename and moving `latest`), or None. One that is garbled, unreadable, or names
    no committed step (a save killed before its rename) is a leftover, not a pointer: ignored."""
    root = Path(root)
    if not _is_dir(root):
        return None
    best: tuple[int, Path] | None = None
    for p in _entries(root):
        if not names.PENDING_LATEST_RE.match(p.name):
            continue
        try:
            text = p.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:  # moved over `latest` meanwhile (which then names its step), or not readable
            continue
        step = names.parse_step_dir(text)
        if step is None or (best is not None and step <= best[0]):
            continue
        target = root / text
        if _is_dir(target) and manifest.load(target)[0] is not None:
            best = (step, target)
    return best[1] if best is not None else None


def find_latest(root: str | os.PathLike[str], advice: Advice = LOAD_ADVICE) -> Path | None:
    """The step folder to resume from: the one `latest` names, else the newest committed one, else None; but
    a newer committed step that a pending `latest` names (`pending_latest`) over the one `latest` names.

    Raises CheckpointError if `latest` names a folder that is missing or has no manifest.json; its fix is
    `advice`'s way of giving another step (the trainer's, or `TOOL_ADVICE`).
    """
    root = Path(root)
    # The pending pointer before `latest`: ranks resolve a load each on its own while rank 0's run start may move
    # it over `latest` (ckpt/cleanup.py); read in this order, a rank that finds it gone reads the moved `latest`.
    pending = pending_latest(root)
    name = read_latest(root)
    if pending is not None and (name is None or names.parse_step_dir(pending.name) > names.parse_step_dir(name)):
        return pending
    if name is None:
        committed = list_committed(root)
        newest = committed[-1] if committed else None
        _refuse_denied_newer(root, names.parse_step_dir(newest.name) if newest is not None else -1)
        return newest
    target = root / name
    if not _is_dir(target):
        why, other = "does not exist", "an existing step folder"
    elif not _is_file(target / names.MANIFEST):
        why, other = "has no manifest.json (never committed)", "a committed step folder"
    else:
        return target
    committed = list_committed(root)  # a step that does load, to name (latest's own is not among them)
    if committed:
        other = f"a step folder such as {committed[-1]}"
    raise CheckpointError(f"{root / names.LATEST} names {name}, which {why}",
                          f"{advice.to_use(other)}, or delete latest to fall back on the newest committed step")


def is_step_dir(path: Path) -> bool:
    """Whether `path` is a single checkpoint (rather than a folder of them): by its name or its manifest.

    Raises CheckpointArgumentError (`unreadable`) when this user may not look inside `path`."""
    return bool(
        _is_file(path / names.MANIFEST)
        or names.STEP_DIR_RE.match(path.name)
        or names.TMP_DIR_RE.match(path.name)
    )


def checkpoint_folder(load: str | os.PathLike[str], advice: Advice = LOAD_ADVICE) -> Path:
    """`load` as the existing folder it names, else a CheckpointArgumentError (exit 2) saying it is empty, does not
    exist or is a file: the one wording of every command that takes a checkpoint (`ckpt validate` said "is not a
    folder" where the others said "is a file, not a checkpoint folder"); `advice` words the fix."""
    if not str(load).strip():
        raise CheckpointArgumentError("the checkpoint path is empty", advice.fix)
    p = Path(load).expanduser()
    st = stat_or_none(p)
    if st is None:
        raise CheckpointArgumentError(f"checkpoint path {p} does not exist", advice.fix)
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointArgumentError(f"checkpoint path {p} is a file, not a checkpoint folder", advice.fix)
    return p


def resolve_load_path(load: str | os.PathLike[str], advice: Advice = LOAD_ADVICE) -> Path:
    """The committed step folder that `load` means: itself if it is a step folder, else its latest step.

    Raises CheckpointError when `load` does not exist, is an uncommitted save, or holds no committed step (a
    CheckpointArgumentError, exit 2, where the path itself is wrong: missing, a file, a run folder, a Hugging
    Face model folder or any other folder that is no checkpoints folder); `advice` words the fixes where the path
    is wrong (the trainer's, about `checkpoint.load`, or `TOOL_ADVICE`).

    A folder without a committed step is a checkpoints folder, and its error a real state (exit 1, like a bad
    checkpoint: `ckpt validate` finds nothing valid there), when it holds a step_NNNNNNNN, `.tmp-` or `.trash-`
    folder (a save that never committed) or is named `checkpoints` (a run's, emptied of its interrupted saves
    when the run restarted, or of a first save that failed cleanly). A `latest` never gets here: it names a step,
    or `find_latest` says what is wrong with it.
    """
    fix = advice.fix
    p = checkpoint_folder(load, advice)
    if is_step_dir(p):
        if names.TMP_DIR_RE.match(p.name) or not _is_file(p / names.MANIFEST):
            raise CheckpointError(
                f"{p} is an interrupted save: it has no manifest.json, so it was never committed",
                "load the checkpoints folder (its latest step) or another committed step_NNNNNNNN folder",
            )
        return p
    found = find_latest(p, advice)
    if found is None:
        where = f"the current folder ({p.absolute()})" if str(p) == "." else str(p)  # an empty argument, too
        sub = p / "checkpoints"
        if _is_dir(sub):
            raise _run_folder(where, sub, advice)
        pending = list_uncommitted(p)
        damaged = _damaged_manifest(pending)
        if damaged is not None:  # not "never committed": the step may have been, and its manifest hurt since
            step, why = damaged
            raise CheckpointError(f"no committed checkpoint in {where}: {step.name} has a manifest.json that cannot be "
                                  f"used ({why}), so it counts as never committed",
                                  f"run `moectl ckpt validate {step}` to see what is wrong with it, or {fix}")
        if pending or p.name == "checkpoints":  # a run's checkpoints folder before its first commit: a real state
            raise CheckpointError(f"no committed checkpoint in {where}: no step was committed yet{_saves(pending)}",
                                  fix)  # fmt: skip
        if _is_file(p / "config.json") and any(p.glob("*.safetensors")):
            hint = "it looks like a Hugging Face model folder: make a checkpoint of it with moectl ckpt import-hf"
        else:
            hint = "it is not a checkpoints folder (no step_NNNNNNNN folder in it)"
        raise CheckpointArgumentError(f"no committed checkpoint in {where}; {hint}", fix)  # the path is wrong: usage
    return found


def _refuse_denied_newer(root: Path, newest: int) -> None:
    """Raise `denied`'s error (exit 2) for a step folder after step `newest` (the newest committed one, or -1)
    whose manifest.json this user may not read: without `latest`, discovery would fall back on an older step
    without a word, or call the step never committed, where a chmod is all that is wrong (a review's finding)."""
    for p in _entries(root) if _is_dir(root) else []:
        step = names.parse_step_dir(p.name)
        if step is not None and step > newest and _is_dir(p):
            refused = denied(p, manifest.load(p)[1])
            if refused is not None:
                raise refused


def _damaged_manifest(pending: list[Path]) -> Optional[tuple[Path, str]]:
    """The newest of `pending`'s step_NNNNNNNN folders whose manifest.json is there but unusable (not valid JSON,
    missing fields, ...), with the first reason; None when each lacks one (a save that never got to write it)."""
    for p in sorted((q for q in pending if names.parse_step_dir(q.name) is not None), reverse=True):
        _, problems = manifest.load(p)
        bad = [pr for pr in problems if pr.kind != P.INCOMPLETE and not pr.denied]  # denied: `denied`, exit 2
        if bad:
            return p, bad[0].message
    return None


def _saves(pending: list[Path]) -> str:
    """` (uncommitted: A, B and 2 more)` for the uncommitted folders of a checkpoints folder (saves interrupted,
    or still in flight), or ""."""
    if not pending:
        return ""
    shown = ", ".join(p.name for p in pending[:2]) + (f" and {len(pending) - 2} more" if len(pending) > 2 else "")
    return f" (uncommitted: {shown})"


def _run_folder(run: str, sub: Path, advice: Advice) -> CheckpointArgumentError:
    """The error for a run folder (train's run_dir, named `run`, holding `sub`, its checkpoints folder) given as a
    checkpoint.

    The path is wrong, not a checkpoint (exit 2, as for a file given there): the fix names what to give instead,
    `sub` and the step it resolves to, or that step itself when `sub`'s `latest` is broken."""
    try:
        step = find_latest(sub, advice)
        target = f"{sub} (its latest step, {step.name})" if step is not None else None
    except CheckpointArgumentError:  # this user may not read it: that error names what to make readable
        raise
    except CheckpointError:  # a broken `latest`: `sub` would not load, the newest committed step still does
        committed = list_committed(sub)
        target = str(committed[-1]) if committed else None
    if target is None:
        return CheckpointArgumentError(f"{run} is a run folder, not a checkpoint, and {sub} holds no committed step",
                                       advice.fix)  # fmt: skip
    return CheckpointArgumentError(f"{run} is a run folder, not a checkpoint", advice.to_use(target))
