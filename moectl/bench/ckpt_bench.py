"""`moectl bench ckpt CONFIG`: a checkpoint's save, validate, convert and inspect against the disk's own speed.

One model state, built by the real trainer from the config (model and optimizer after one training step,
so the moments are not zeros), is saved and read back through the public APIs, and each figure stands
beside a floor measured in the same run, on the same bytes and the same folder:

    save, synchronous     `save_training_checkpoint` (gather, probe, write, hash, vote, commit)
    save, background      `RunCheckpointer.reserve` (the host buffers a run allocates, on CUDA page-locks, at
                          start-up), then `RunCheckpointer.save` + `finish`: the blocking time and the time to
                          commit, twice (the first and a later save of a run); each total row carries this
                          rank's seconds per part of the save (`phases`: prepare, write, fsync, vote, commit)
    plain write (floor)   the same files' bytes, read into memory first (untimed), written by one plain
                          sequential writer per rank (open, write, fsync, as `open(...).write` would)
    raw read / copy       the same bytes read back sequentially in large chunks, and copied (read + write +
                          fsync), by one process, from a cold page cache
    inspect --verify      `inspect_checkpoint(verify=True)`, against the raw read
    convert               `convert_checkpoint` to the other expert layout, against the raw copy
    validate              `validate_checkpoint` (every rank, as under torchrun), against the raw read

Before every read the files are dropped from the page cache (`posix_fadvise(DONTNEED)`, which the OS honours
for pages already on disk), so each reader starts cold; the JSON records whether that was possible. With
several ranks, the saves and validate run on every rank and report the slowest rank; the single-process
tools (inspect, convert) and the raw reads run on rank 0 while the others wait.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ckpt.durable import fsync_dir
from moectl.bench.result import RowsResult
from moectl.bench.train_shrink import quick_overrides
from moectl.core.config.load import load_config
from moectl.core.config.schema import Config
from moectl.core.errors import UsageError
from moectl.core.params import count_params

Log = Callable[[str], None]
_CHUNK = 64 << 20  # the raw reader's and copier's chunk: large sequential I/O, as a careful plain tool does


@dataclass
class CkptBenchConfig:
    """What to measure: a config file with `--set` overrides, where to write, and the CPU quick shrink."""

    config: Path
    sets: list[str] = field(default_factory=list)
    folder: Optional[Path] = None  # default: <the config's run_dir>/bench_ckpt
    quick: bool = False
    keep: bool = False  # leave the synchronous save on disk afterwards
    saves_only: bool = False  # skip the tools and their raw reads (a scale table's cheap rows)


#: written into the bench's folder when it is made: a folder holding it is an earlier bench's, safe to replace
MARKER = ".moectl-bench-ckpt"
#: the folders each phase writes under it: the synchronous saves, the background ones, the raw-write baseline,
#: the tools' raw copy and conversion
SYNC, BG, PLAIN, COPY, CONVERTED = "sync", "bg", "plain", "copy", "converted"
#: everything the bench writes into its folder: all it ever removes there, and all a folder it takes may hold
WRITES = frozenset({MARKER, SYNC, BG, PLAIN, COPY, CONVERTED})


def check_folder(folder: Path) -> None:
    """Refuse a `--dir` the bench may not take: it replaces the folder at start and removes it at the end, so a
    folder holding anything an earlier bench did not write (a run's checkpoints, the current folder's files)
    would be deleted."""
    fix = f"pass a new or empty folder (it is created), e.g. {folder / 'bench_ckpt'}"
    here = Path.cwd().resolve()
    if folder.resolve() == here or folder.resolve() in here.parents:
        raise UsageError(f"bench ckpt --dir {folder} is the current folder or holds it; the bench removes it at the end",
                         fix)  # fmt: skip
    if not folder.exists():
        return
    if not folder.is_dir():
        raise UsageError(f"bench ckpt --dir {folder} is a file", fix)
    entries = [p.name for p in folder.iterdir()]
    # an earlier bench's folder (its marker) holds only what a bench writes: anything else is someone's
    foreign = sorted(e for e in entries if e not in WRITES) if MARKER in entries else sorted(entries)
    if foreign:
        raise UsageError(f"bench ckpt --dir {folder} holds {len(foreign)} entries the bench did not write (e.g. "
                         f"{foreign[0]}); it would delete them", fix)  # fmt: skip


def _make_folder(folder: Path, written: _Written) -> None:
    """Make the bench's folder (an earlier bench's replaced) and mark it. `written.made` gets the folders it makes,
    deepest first, so the end can remove the parents it made too (an empty runs/tiny/ was left in the working
    folder); set before any is made, so a run interrupted here removes them as well."""
    check_folder(folder)
    written.made = made = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        if folder.exists():
            _empty(folder)  # the folder itself stays: the user's (a mount point, say), not the bench's to remove
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MARKER).touch()
    except OSError as e:  # a dangling symlink, a path under /proc, no permission
        raise UsageError(f"bench ckpt --dir {folder}: {e.strerror or e}",
                         f"pass a new or empty folder the bench can write, e.g. {Path.cwd() / 'bench_ckpt'}") from None


def _empty(folder: Path) -> None:
    """Remove what the bench writes in `folder` (`WRITES`); anything else there stays."""
    for entry in folder.iterdir():
        if entry.name not in WRITES:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _remove_folder(folder: Path, made: list[Path]) -> None:
    """Remove what the bench wrote: the folders it made, or only the contents of one that was there before."""
    if folder not in made:
        _empty(folder)
        return
    if folder.exists():  # a run interrupted while it made its folders may not have got to this one
        shutil.rmtree(folder)
    for parent in made[1:]:  # made[0] is `folder`
        try:
            parent.rmdir()  # only if empty
        except FileNotFoundError:
            continue
        except OSError:
            break


@dataclass
class _Written:
    """What a run of the bench has written so far, for `remove` when it does not finish."""

    #: the folders this rank made (`_make_folder`); None where the folder is not this rank's to remove (another
    #: rank's, or one `check_folder` has not passed: a folder of the user's is never touched)
    made: Optional[list[Path]] = None
    #: the background saver, whose writer thread goes on writing into the folder after the main thread stops
    saver: Any = None

    def remove(self, folder: Path) -> None:
        """Let a background save in flight end, then remove what this run wrote (rank 0). Never raises: the way
        the run ended (a Ctrl-C's line, the error) is what the user must see. With several ranks, another may
        still be writing as rank 0 removes the folder: best effort there."""
        if self.saver is not None:
            try:
                self.saver.abandon()
            except Exception:  # its own failure: the folder goes all the same
                pass
        if self.made is None:
            return
        try:
            _remove_folder(folder, self.made)
        except OSError:
            pass


class CkptBenchResult(RowsResult):
    """Every measured time (seconds), its floor, and what they were measured on."""


def bench_folder(bench: CkptBenchConfig, base: Optional[Config] = None) -> Path:
    """Where the bench writes: `--dir`, else the config's run_dir/bench_ckpt (`base`: the config as loaded
    already, else it is loaded)."""
    if bench.folder is not None:
        return bench.folder
    return Path((base or load_config(bench.config, bench.sets)).run_dir) / "bench_ckpt"


def bench_config(bench: CkptBenchConfig, world_size: int = 1) -> Config:
    """The config the bench builds: the file, the quick shrink, the user's `--set`, then its own settings (a run
    of one step that saves nothing by itself; the run_dir is the bench's folder)."""
    base = load_config(bench.config, bench.sets)
    shrink = quick_overrides(base, world_size) if bench.quick else []
    folder = bench_folder(bench, base)
    fixed = ["train.eval_interval=null", "checkpoint.save_interval=null", "checkpoint.load=null",
             "checkpoint.keep_last=null", f"run_dir={folder / 'run'}"]  # fmt: skip
    return load_config(bench.config, [*shrink, *bench.sets, *fixed])


# --- ranks --------------------------------------------------------------------------------------------
def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _barrier() -> None:
    if _world()[1] > 1:
        dist.barrier()


def _slowest(seconds: float) -> float:
    """The largest of every rank's `seconds` (a collective)."""
    if _world()[1] == 1:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """`fn()` on rank 0 while the others wait; its result on rank 0, None elsewhere."""
    out = fn() if _world()[0] == 0 else None
    _barrier()
    return out


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


# --- raw I/O, the floors ------------------------------------------------------------------------------
def drop_from_cache(paths: list[Path]) -> bool:
    """Ask the OS to drop the files' clean pages from the page cache; False where it cannot be asked."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # only clean pages can be dropped
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def raw_read(paths: list[Path]) -> int:
    """Read every file sequentially in large chunks into one reused buffer; returns the bytes read."""
    buf = _buffer(paths)
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def raw_copy(paths: list[Path], dst: Path) -> int:
    """Copy every file into `dst` as a plain tool would (read a chunk, write it; fsync each file and the folder)."""
    dst.mkdir(parents=True, exist_ok=True)
    buf = _buffer(paths)
    view = memoryview(buf)
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as src, open(dst / p.name, "wb", buffering=0) as out:
            while n := src.readinto(buf):
                write_all(out, view[:n])
                total += n
            os.fsync(out.fileno())
    fsync_dir(dst)
    return total


def _buffer(paths: list[Path]) -> bytearray:
    """One chunk's buffer, no larger than the largest file (allocating 64 MiB would dwarf a small file's read)."""
    return bytearray(max(1, min(_CHUNK, max((p.stat().st_size for p in paths), default=1))))


def plain_write(blobs: dict[str, bytes], dst: Path) -> None:
    """Write each file's bytes sequentially and fsync it, then fsync the folder: the floor.

    The bytes go out in `write` calls of at most `_CHUNK`, looping until all are written: one unbuffered
    `write` of a whole file is not enough, since Linux writes at most 2 GiB - 4 KiB per call and returns
    the count (`f.write(data)` once, as this floor did until the ninth session, wrote 2.15 GB of each
    11 GB optimizer file of the reference model and so timed under a third of the bytes it claimed)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name, data in blobs.items():
        with open(dst / name, "wb", buffering=0) as f:
            write_all(f, memoryview(data))
            os.fsync(f.fileno())
    fsync_dir(dst)


def write_all(f: Any, view: memoryview) -> None:
    """Write all of `view` to the unbuffered file `f` in chunks of at most `_CHUNK` (short writes resumed)."""
    pos = 0
    while pos < len(view):
        n = f.write(view[pos : pos + _CHUNK])
        if not n:
            raise OSError(f"write returned {n} at byte {pos} of {len(view)}")
        pos += n


# --- the measurements ---------------------------------------------------------------------------------
def _row(measure: str, seconds: float, nbytes: int, floor: Optional[str] = None, floor_s: Optional[float] = None,
         **extra: Any) -> dict[str, Any]:
    return {"measure": measure, "seconds": seconds, "bytes": nbytes,
            "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else None, "floor": floor, "floor_seconds": floor_s,
            "vs_floor": seconds / floor_s if floor_s else None, **extra}  # fmt: skip


def run(bench: CkptBenchConfig, cfg: Config, meta: dict[str, Any], log: Log = lambda s: None) -> CkptBenchResult:
    """Measure everything (collective under torchrun); rank 0's result holds the table.

    A run that does not finish (Ctrl-C, SIGTERM, an error) removes what it wrote, --keep or not: its folder (only
    the contents of one that was there), and the parents it made. Left behind, its scratch files stayed until the
    next run emptied the folder.
    """
    written = _Written()
    try:
        return _measure(bench, cfg, meta, log, written)
    except BaseException:  # the CLI's Ctrl-C and SIGTERM too (KeyboardInterrupt, its `Stopped`)
        written.remove(Path(cfg.run_dir).parent)
        raise


def _measure(bench: CkptBenchConfig, cfg: Config, meta: dict[str, Any], log: Log,
             written: _Written) -> CkptBenchResult:  # fmt: skip
    """`run`'s measurements; `written` follows what they write."""
    from ckpt import open_checkpoint
    from ckpt.convert import convert_checkpoint
    from ckpt.inspect import inspect_checkpoint
    from trainer.checkpointing.save import save_training_checkpoint
    from trainer.checkpointing.saver import RunCheckpointer
    from trainer.loop import Trainer
    from trainer.observer import SilentObserver
    from trainer.validation import validate_checkpoint

    folder = Path(cfg.run_dir).parent
    result = CkptBenchResult(meta)
    start, said = time.perf_counter(), log

    def log(line: str) -> None:  # stamped, so a run cut short still tells how long each phase took
        said(f"[{time.perf_counter() - start:7.1f} s] {line}")

    # Under torchrun the process group does not exist yet (the trainer joins it): the rank is torchrun's.
    if (_world()[0] if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0:
        _make_folder(folder, written)

    log("building the model and taking one training step")
    trainer = Trainer(cfg, SilentObserver())
    rank, world = _world()  # the trainer joined the job's process group
    _barrier()  # rank 0 has made the folder
    trainer.train_step(0)
    params = count_params(cfg.model, cfg.moe)
    meta["model"] = {"params": params.total, "layers": cfg.model.num_layers, "hidden": cfg.model.hidden_size,
                     "experts": cfg.moe.num_experts, "expert_layout": "single-grouped" if cfg.moe.single_grouped_weight
                     else "per-expert"}  # fmt: skip
    meta["world_size"] = world
    step = 1
    sync_root = folder / SYNC

    log("synchronous save")
    _barrier()
    sync_phases: dict[str, float] = {}
    sync_s, sync_path = _timed(lambda: save_training_checkpoint(sync_root, step, cfg, trainer.engine, trainer.rt.pstate,
                                                                trainer.probe_loss(), phases=sync_phases))  # fmt: skip
    log(f"  {_phase_line(sync_phases)}")
    sync_s = _slowest(sync_s)
    with open_checkpoint(sync_path, verify=False) as ck:
        files = {f: rec for f, rec in ck.manifest["files"].items()}
    total_bytes = sum(rec["size"] for rec in files.values())
    mine = [sync_path / f for f, rec in files.items() if rec["rank"] == trainer.rt.rank]
    every = [sync_path / f for f in files]
    meta["checkpoint_bytes"] = total_bytes
    meta["files"] = len(files)

    saver = written.saver = RunCheckpointer(cfg, trainer.engine, trainer.rt.pstate, folder / BG)
    log("reserving the background save's host buffers, as a run does at start-up")
    _barrier()
    reserved = saver.reserve(step)
    reserve_s = _slowest(reserved.seconds) if reserved is not None else None
    if reserved is not None and reserved.why_not:
        result.notes.append(f"no host buffers reserved: {reserved.why_not}")
    background: list[tuple[str, float, float, dict[str, float]]] = []
    for label in ("first", "second"):
        log(f"background save ({label} save of the run)")
        _barrier()
        t0 = time.perf_counter()
        saver.save(step, trainer.probe_loss)
        report = saver.finish()
        total_s = _slowest(time.perf_counter() - t0)
        assert report is not None
        if report.mode != "background":
            result.notes.append(f"the background save ran synchronously: {report.why or saver.why_not}")
        background.append((label, _slowest(report.blocking_s), total_s, report.phases))
        log(f"  {_phase_line(report.phases)}")
        _on_rank0(lambda: shutil.rmtree(folder / BG))
    saver.close()
    written.saver = None

    log("plain sequential writer (the floor)")
    blobs = {p.name: p.read_bytes() for p in mine}  # untimed: the bytes are in memory, as the save's were
    _barrier()
    plain_s, _ = _timed(lambda: plain_write(blobs, folder / PLAIN))
    plain_s = _slowest(plain_s)
    del blobs
    _on_rank0(lambda: shutil.rmtree(folder / PLAIN))
    result.rows.append(_row("plain sequential write (floor)", plain_s, total_bytes))
    result.rows.append(_row("save, synchronous", sync_s, total_bytes, "plain write", plain_s, phases=sync_phases))
    if reserve_s is not None:
        result.rows.append(_row("save, background: host buffers reserved at start-up", reserve_s, total_bytes))
    for label, blocking_s, total_s, phases in background:
        result.rows.append(_row(f"save, background ({label} save): blocking", blocking_s, total_bytes))
        result.rows.append(_row(f"save, background ({label} save): total", total_s, total_bytes, "plain write",
                                plain_s, phases=phases))  # fmt: skip

    # Free the training state before the tools build their own (validate builds a whole trainer).
    del trainer, saver
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    cold = {"dropped": True}

    def cold_start() -> None:
        cold["dropped"] = drop_from_cache(every) and cold["dropped"]

    def tools() -> dict[str, float]:
        out = {}
        log("raw read and copy of the same bytes (rank 0)")
        cold_start()
        out["read"], _ = _timed(lambda: raw_read(every))
        cold_start()
        out["copy"], _ = _timed(lambda: raw_copy(every, folder / COPY))
        shutil.rmtree(folder / COPY)
        log("ckpt inspect --verify (rank 0)")
        cold_start()
        out["inspect"], summary = _timed(lambda: inspect_checkpoint(sync_path, verify=True))
        if summary.problems:
            raise AssertionError(f"the benchmark's checkpoint does not verify: {summary.problems[:3]}")
        log("ckpt convert (rank 0)")
        cold_start()
        out["convert"], _ = _timed(lambda: convert_checkpoint(sync_path, folder / CONVERTED, other_layout(cfg)))
        shutil.rmtree(folder / CONVERTED)
        cold_start()
        return out

    if bench.saves_only:
        result.notes.append("--saves-only: the tools (inspect, convert, validate) and the raw reads were skipped")
        if not bench.keep:
            _on_rank0(lambda: _remove_folder(folder, written.made or []))
        return result
    t = _on_rank0(tools)
    log("ckpt validate (every rank)")
    _barrier()
    validate_s, report = _timed(lambda: validate_checkpoint(sync_path))
    validate_s = _slowest(validate_s)
    if not report.ok:
        raise AssertionError(f"the benchmark's checkpoint does not validate: {report.failures()[:3]}")
    if rank == 0:
        result.rows += [
            _row("raw read (floor)", t["read"], total_bytes),
            _row("raw copy: read + write (floor)", t["copy"], total_bytes),
            _row("ckpt inspect --verify", t["inspect"], total_bytes, "raw read", t["read"]),
            _row("ckpt convert", t["convert"], total_bytes, "raw copy", t["copy"], to=other_layout(cfg)),
            _row("ckpt validate", validate_s, total_bytes, "raw read", t["read"]),
        ]
        meta["page_cache_dropped"] = cold["dropped"]
        if not cold["dropped"]:
            result.notes.append("the page cache could not be dropped: reads may have been served from memory")
    if not bench.keep:
        _on_rank0(lambda: _remove_folder(folder, written.made or []))
    return result


def _phase_line(phases: dict[str, float]) -> str:
    """This rank's seconds per part of a save, for the log (the JSON rows carry them as `phases`)."""
    return "this rank: " + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in phases.items())


def other_layout(cfg: Config) -> str:
    """The expert layout `ckpt convert` turns this config's checkpoints into."""
    from ckpt.layout import PER_EXPERT, SINGLE_GROUPED

    return PER_EXPERT if cfg.moe.single_grouped_weight else SINGLE_GROUPED


def host_meta(folder: Path) -> dict[str, Any]:
    """The machine the numbers come from: CPUs, memory, load, and the filesystem the folder is on."""
    out: dict[str, Any] = {"cpus": os.cpu_count()}
    try:
        out["cpus_usable"] = len(os.sched_getaffinity(0))
        out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        pass
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            mounts = [line.split()[:3] for line in f]
        best = max((m for m in mounts if str(probe.resolve()).startswith(m[1])), key=lambda m: len(m[1]))
        out["filesystem"] = {"device": best[0], "mount": best[1], "type": best[2]}
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            out["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return out
