"""run_dir hygiene: create it with a one-line error, hold it against a second run, never overwrite a run silently.

Training again into a run_dir used to replace its `metrics.jsonl` and `config.yaml` without a word (the
README's own examples reuse `runs/tiny`), and a `--run-dir` that could not be created, or a
`metrics.jsonl` that was a folder, ended in a traceback (issue 18). Here, before the first step, on the
rank that writes (rank 0):

- the folder is created, or the run refuses with one line saying why (a file in the way, a parent that is
  a file, no permission, a filesystem that takes no folders such as /proc);
- a lock (`.moectl.lock`, flock) makes a second `moectl train` into the same run_dir refuse while the first
  runs: the cleanup below, and the metrics file, must not be shared;
- a fresh run (no `checkpoint.load`) refuses a run_dir whose `metrics.jsonl` holds records, unless told
  to overwrite them (`--overwrite`); a resume keeps them (`MetricsWriter` cuts them back to the resumed
  step);
- a resume from step N that saves refuses a run_dir whose `checkpoints/` already holds committed steps after
  N: it would cut their records from `metrics.jsonl`, train, and then fail when its save reached one of their
  folders (a resume that saves nothing replays from N, as any resume does: its records replace theirs);
- interrupted-save folders under `checkpoints/` are removed (`ckpt.cleanup`: only the ones a save wrote);
- a run that saves refuses a `checkpoints/` it could not save into (a file, a folder this user may not
  write, a `latest` that is a folder): found only at its first save, that cost every step before it.

And before any of it, in the CLI (`check_config_not_replaced`): the config file passed to `train` is never
the `config.yaml` the run writes, unless it is one a run wrote (its first line, `CONFIG_HEADER`) or already
holds the resolved text: a user's file there would lose its comments and take the `--set` overrides.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path
from typing import IO

from ckpt import names
from ckpt.cleanup import remove_interrupted_saves
from ckpt.discovery import list_committed
from ckpt.integrity import quick_problem
from moectl.core.config import Config, dump_config
from moectl.core.errors import UsageError

METRICS = "metrics.jsonl"
LOCK = ".moectl.lock"
CONFIG = "config.yaml"
#: the first line of the config.yaml a run writes: such a file may be rewritten by the next run
CONFIG_HEADER = "# the resolved config of the run in this folder, written by moectl train (each run rewrites it)\n"


def _what_is(path: Path) -> str:
    """What `path` is, when it is not a folder: "a file", "a character device" (/dev/null), "a named pipe
    (FIFO)", "a socket", ..."""
    try:
        mode = path.stat().st_mode
    except OSError:  # a symbolic link to nothing
        return "a broken symbolic link" if path.is_symlink() else "not a folder"
    for test, what in ((stat.S_ISREG, "a file"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return what
    return "not a folder"


def create_run_dir(path: Path) -> None:
    """`mkdir -p path`, as a one-line `UsageError` naming the reason when that is impossible."""
    fix = "choose another --run-dir (or set run_dir in the config)"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        what = _what_is(path)
        if what == "a file":  # a stray file of the user's: removing it is theirs to choose
            raise UsageError(f"run_dir {path} cannot be created: a file is in the way",
                             f"remove that file, or {fix}") from None  # fmt: skip
        # /dev/null, a FIFO, a socket: never advise deleting one (a user trial: "remove that file" for /dev/null)
        raise UsageError(f"run_dir {path} exists and is not a directory: it is {what}", fix) from None
    except NotADirectoryError:
        parent = next((p for p in path.parents if p.exists() and not p.is_dir()), path.parent)
        raise UsageError(f"run_dir {path} cannot be created: {parent} is {_what_is(parent)}, not a folder",
                         fix) from None  # fmt: skip
    except PermissionError as e:
        raise UsageError(f"run_dir {path} cannot be created: {e.strerror or 'permission denied'}", fix) from None
    except OSError as e:
        why = e.strerror or type(e).__name__
        if e.errno == errno.ENOENT:  # /proc, /sys: the path exists as a name, but takes no new folders
            why = "this filesystem does not allow creating it"
        raise UsageError(f"run_dir {path} cannot be created: {why}", fix) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"run_dir {path} is not writable by this user", fix)


class RunDirLock:
    """An exclusive flock on `run_dir/.moectl.lock` for the run's lifetime (released by `release` or exit)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK
        self._file: IO[str] | None = None
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, the other checks still apply
            return
        try:
            f = open(self.path, "a+")
        except OSError as e:
            raise UsageError(f"run_dir {run_dir}: cannot open {LOCK} ({e.strerror or e})",
                             "choose a writable --run-dir") from None  # fmt: skip
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # nothing trained: a usage error (2)
                raise UsageError(
                    f"run_dir {run_dir} is in use by another moectl train (pid {holder})",
                    "wait for it to finish, stop it, or train into another --run-dir",
                ) from None
            return  # a filesystem without flock (some network mounts): run without the lock
        try:
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()}\n")
            f.flush()
        except OSError as e:  # a full disk: nothing else the run writes would fit either
            with contextlib.suppress(OSError):
                f.close()
            raise UsageError(f"run_dir {run_dir}: cannot write {LOCK} ({e.strerror or e})",
                             "free space on its filesystem, or choose another --run-dir") from None  # fmt: skip
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the flock
            self._file = None


def metric_records(path: Path) -> list[int]:
    """The steps of the records in an existing metrics file (unreadable lines skipped)."""
    steps = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                steps.append(rec["step"])
    return steps


def check_metrics_file(run_dir: Path, *, resuming: bool, overwrite: bool) -> None:
    """Refuse a `metrics.jsonl` that is not a file, or that holds another run's records in a fresh run."""
    path = run_dir / METRICS
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file"
        raise UsageError(f"{path} is {kind}, so the run cannot write its metrics there",
                         f"move {path} away, or train into another --run-dir")  # fmt: skip
    if resuming or overwrite or path.stat().st_size == 0:
        return
    steps = metric_records(path)
    span = f"steps {min(steps)}-{max(steps)}" if steps else "unreadable records"
    # the resume is advice only where that run left a checkpoint to resume from (a user trial: junk there got it)
    resume = (f"resume that run with --set checkpoint.load={run_dir / 'checkpoints'}, "
              if list_committed(run_dir / "checkpoints") else "")
    raise UsageError(
        f"run_dir {run_dir} holds another run's {METRICS} ({len(steps)} records, {span}); a fresh run would "
        "replace it",
        f"{resume}train into another --run-dir, or pass --overwrite to replace its metrics and config.yaml",
    )


def check_later_checkpoints(run_dir: Path, start: int) -> None:
    """Refuse a saving resume from step `start` into a run_dir whose checkpoints go further (another branch of
    the run, or the rest of it): its metrics records after `start` would be dropped, and its step folders
    collide with this run's saves."""
    root = run_dir / "checkpoints"
    later = [p.name for p in list_committed(root) if (names.parse_step_dir(p.name) or 0) > start]
    if not later:
        return
    span = later[0] if len(later) == 1 else f"{later[0]}..{later[-1]}"
    why = f"run_dir {run_dir} holds {len(later)} checkpoint(s) after step {start} ({span}): a resume from step {start} "
    why += "that saves there would drop their metrics and collide with their folders"
    broken = quick_problem(root / later[-1])
    if broken is not None:  # the newest is damaged (why the user went back): do not send them to it
        raise UsageError(f"{why}; the newest, {later[-1]}, is damaged ({broken})",
                         f"move {span} out of {root} to resume from step {start} here (ckpt validate "
                         f"{root / later[-1]} lists what is wrong), or resume into another --run-dir")  # fmt: skip
    raise UsageError(
        why,
        # the newest by name: `latest` may name an older step (a rollback), and loading the folder would follow it
        f"resume from the newest with --set checkpoint.load={root / later[-1]}, resume into another --run-dir, or "
        f"move {span} out of {root}",
    )


def resolved_config_text(cfg: Config) -> str:
    """What a run writes into `run_dir/config.yaml`: `CONFIG_HEADER`, then the resolved config."""
    return CONFIG_HEADER + dump_config(cfg)


def check_config_not_replaced(config_path: str | os.PathLike[str], cfg: Config) -> None:
    """Refuse a run whose `run_dir/config.yaml` is the config file passed to it, unless a run wrote that file
    (it starts with `CONFIG_HEADER`) or it holds the resolved config already: the run would replace the user's
    own file (comments, and values the `--set` overrides change)."""
    target = Path(cfg.run_dir) / CONFIG
    try:
        same = target.is_file() and os.path.samefile(config_path, target)
    except OSError:
        return
    if not same:
        return
    text = target.read_text(encoding="utf-8", errors="replace")
    if text.startswith(CONFIG_HEADER) or text == dump_config(cfg):
        return  # a run's own file (or one written before the header existed, unchanged): nothing of the user's
    raise UsageError(
        f"{config_path} is the {CONFIG} the run writes into run_dir {cfg.run_dir}: the resolved config would replace "
        "your file",
        "train into another --run-dir, or copy the config out of that folder and pass the copy",
    )


def check_checkpoints_folder(root: Path) -> None:
    """Refuse, as a one-line `UsageError`, a checkpoints folder `root` a save could not write: a file (or
    anything not a folder) in its place, a folder this user may not write, or a `latest` that is no file. A
    `root` not there yet is fine: the first save creates it in run_dir, which `create_run_dir` found writable."""
    fix = "move it out of the way, or train into another --run-dir"
    if root.exists() or root.is_symlink():
        if not root.is_dir():
            raise UsageError(f"{root} is {_what_is(root)}, not a folder: the run could not save a checkpoint", fix)
        if not os.access(root, os.W_OK | os.X_OK):
            raise UsageError(f"{root} is not writable by this user: the run could not save a checkpoint",
                             "make it writable (e.g. chmod u+rwx on it), or train into another --run-dir")
        latest = root / names.LATEST  # a broken link there is fine: a save's os.replace puts a file over it
        if latest.exists() and not latest.is_file():
            what = "a folder" if latest.is_dir() else _what_is(latest)
            raise UsageError(f"{latest} is {what}, not the file a save rewrites: the run could not commit a "
                             "checkpoint", fix)  # fmt: skip


def prepare_run_dir(run_dir: Path, *, resuming: bool, overwrite: bool, resumed_at: int | None = None,
                    saves: bool = False) -> tuple[RunDirLock, list[str]]:  # fmt: skip
    """Everything above, in order; returns the held lock and lines worth logging (removed folders). `resuming`:
    the run continues after a step > 0 (its metrics are kept up to it); `resumed_at`: the step of the loaded
    checkpoint where the run will save checkpoints from it (`check_later_checkpoints`), else None; `saves`:
    the run saves checkpoints (`check_checkpoints_folder`)."""
    create_run_dir(run_dir)
    lock = RunDirLock(run_dir)
    try:
        if saves:
            check_checkpoints_folder(run_dir / "checkpoints")
        if resumed_at is not None:
            check_later_checkpoints(run_dir, resumed_at)
        check_metrics_file(run_dir, resuming=resuming, overwrite=overwrite)
        cleanup = remove_interrupted_saves(run_dir / "checkpoints")
    except BaseException:
        lock.release()
        raise
    lines = [f"removed {p.name}: an interrupted save's leftovers" for p in cleanup.removed]
    if cleanup.latest is not None:
        lines.append(f"checkpoints/latest now names {cleanup.latest.name}: its save was killed after committing it, "
                     "before it moved latest")  # fmt: skip
    lines += [f"warning: left {p} alone: {why}" for p, why in cleanup.kept]
    return lock, lines
