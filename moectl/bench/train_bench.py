"""`moectl bench train`: the real trainer's step, measured column by column (train_columns.py).

Each column builds a fresh `trainer.loop.Trainer` from the config with the column's overrides (the same
model, engine and data as `moectl train`), then runs `train_step` through the public API:

    warm-up steps   untimed (torch.compile builds its graphs here; `warmup_s` says how long they took)
    timed steps     wall time per step with the device synchronised at its end, as `moectl train` times it;
                    tokens/s = tokens per step / median step time, MFU from trainer/flops.py against the
                    GPU's dense peak (known GPUs only), peak memory = torch.cuda.max_memory_allocated over
                    these steps, reserved = torch.cuda.max_memory_reserved over the whole column, warm-up
                    included (the footprint: a CUDA graph's pool counts there once its capture freed its
                    blocks), each the largest over ranks
    profiled steps  a torch.profiler pass over 1-2 more steps (after one unrecorded), split into categories (device_time.py); idle
                    = median step time - busy device time (the profiler's host overhead stretches the
                    profiled steps themselves, so their own wall time is only reported beside)

Between columns everything is freed (model, optimizer, compiled graphs, the CUDA cache). A column that runs
out of memory, or that the config cannot run (a `MoectlError`), gets an error row; the others still run.
With several processes (torchrun), every rank runs every step, and rank 0's numbers are reported:
tokens/s is the whole job's, tokens/s per GPU divides it by the world size.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from moectl.bench.oom import as_oom, free
from moectl.bench.result import RowsResult
from moectl.bench.train_columns import Column
from moectl.bench.train_shrink import quick_overrides
from moectl.core.config.load import load_config
from moectl.core.config.schema import Config
from moectl.core.errors import DataError, MoectlError

Log = Callable[[str], None]


@dataclass
class TrainBenchConfig:
    """What to run: a config file with `--set` overrides, the columns, and how many steps of each kind."""

    config: Path
    sets: list[str] = field(default_factory=list)
    columns: list[Column] = field(default_factory=list)
    steps: int = 10
    warmup: int = 3
    profile_steps: int = 2
    quick: bool = False

    @staticmethod
    def quick_steps() -> dict[str, int]:
        """Step counts of `--quick` (the CI smoke test): 2 timed steps, 1 warm-up, 1 profiled."""
        return {"steps": 2, "warmup": 1, "profile_steps": 1}


class TrainBenchResult(RowsResult):
    """One row per column, and what they were measured on."""


def column_config(bench: TrainBenchConfig, column: Column, world_size: int = 1) -> Config:
    """The column's config: the file, the quick shrink (`--quick`), the user's `--set`, the bench's own
    settings (no eval, no checkpoints, enough train_iters for the LR schedule), then the column's overrides."""
    base = load_config(bench.config, bench.sets)
    shrink = quick_overrides(base, world_size) if bench.quick else []
    total = bench.warmup + bench.steps + bench.profile_steps + 1  # + the profiler's unrecorded step
    fixed = ["train.eval_interval=null", "checkpoint.save_interval=null", "checkpoint.load=null",
             f"train.train_iters={max(base.train.train_iters, total)}"]  # fmt: skip
    return load_config(bench.config, [*shrink, *bench.sets, *fixed, *column.overrides])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(value: float, device: torch.device) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _profile(trainer: Any, first_step: int, n: int, median_ms: float) -> tuple[dict[str, Any], int]:
    """Profile `n` more steps, after one under the profiler unrecorded (its start-up, CUPTI's included, lands
    there); the category split (rank 0) and the next step index."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from moectl.bench.device_time import activities, split
    from moectl.bench.profiler_chatter import without_profiler_chatter
    from trainer import regions

    device = trainer.rt.device
    kinds = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step, wall_ms = first_step, 0.0
    plan = schedule(wait=0, warmup=1, active=n, repeat=1)
    with without_profiler_chatter(), profile(activities=kinds, schedule=plan) as prof:
        for i in range(n + 1):
            if i == 1:
                t0 = time.perf_counter()
            trainer.train_step(step)
            step += 1
            if i == n:  # before the last prof.step(), which stops the profiler and collects the trace
                _sync(device)
                wall_ms = (time.perf_counter() - t0) * 1e3 / n
            prof.step()
    if not _rank0():
        return {}, step
    s = split(activities(prof.events(), regions.ALL, device.type), n)
    out = s.to_json()
    out.update(profiled_step_ms=wall_ms, idle_ms=max(median_ms - s.busy_ms, 0.0), step_ms=median_ms)
    return out, step


def measure_column(cfg: Config, column: Column, bench: TrainBenchConfig, log: Log) -> dict[str, Any]:
    """Build the trainer for `cfg`, warm up, time, profile; the column's row (plain data only)."""
    from moectl.core.params import count_params
    from trainer.loop import Trainer
    from trainer.observer import SilentObserver

    trainer = Trainer(cfg, SilentObserver())
    device, world = trainer.rt.device, trainer.rt.world_size
    moe = trainer.model.moe_layers()
    row: dict[str, Any] = {
        "column": column.name, "description": column.description, "overrides": list(column.overrides),
        "compile": cfg.train.compile, "compiled_regions": len(trainer.compiled_regions),
        "expert_backend": moe[0].experts.backend(device).name if moe else None,
        "cuda_graph": trainer.graph is not None,
    }  # fmt: skip
    params = count_params(cfg.model, cfg.moe)
    row["model"] = {"params": params.total, "active_params": params.active, "world_size": world,
                    "tokens_per_step": trainer.tokens_per_step, "flops_per_step": trainer.flops_per_step,
                    "device": str(device)}  # fmt: skip
    step = 0
    log(f"{column.name}: {bench.warmup} warm-up step(s)" + (" (compiling)" if trainer.compiled_regions else ""))
    t0 = time.perf_counter()
    for _ in range(bench.warmup):
        trainer.train_step(step)
        step += 1
    _sync(device)
    row["warmup_s"] = time.perf_counter() - t0
    # CUDA graphs allocate at their capture (a warm-up step) and replay in their private pool, whose blocks count
    # as reserved, not allocated, once the capture freed them: the footprint is the reserved peak of the run
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(bench.steps):
        t0 = time.perf_counter()
        record = trainer.train_step(step)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(record["loss"])
        step += 1
    median = statistics.median(times)
    tps = trainer.tokens_per_step / (median * 1e-3)
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if device.type == "cuda":
        reserved = max(reserved, torch.cuda.max_memory_reserved(device))
    row.update(
        step_ms=median, step_ms_min=min(times), step_ms_max=max(times), step_ms_all=times, losses=losses,
        tokens_per_s=tps, tokens_per_s_per_gpu=tps / world,
        mfu=trainer.flops_per_step / (median * 1e-3) / (trainer.peak * 1e12 * world) if trainer.peak else None,
        peak_mem_gib=None if peak_mem is None else _max_over_ranks(peak_mem, device),
        reserved_gib=None if peak_mem is None else _max_over_ranks(reserved / 2**30, device),
    )  # fmt: skip
    log(f"{column.name}: {median:.1f} ms/step, {tps:,.0f} tokens/s")
    if bench.profile_steps:
        log(f"{column.name}: profiling {bench.profile_steps} step(s)")
        row["profile"], step = _profile(trainer, step, bench.profile_steps, median)
    return row


def _free() -> None:
    """Drop what a column left: its compiled graphs, its tensors, the allocator's cached blocks."""
    import torch._dynamo

    torch._dynamo.reset()
    free("cuda" if torch.cuda.is_available() else "cpu")


def _error_row(column: Column, message: str) -> dict[str, Any]:
    return {"column": column.name, "description": column.description, "overrides": list(column.overrides),
            "error": message}  # fmt: skip


def run_column(cfg: Config, column: Column, bench: TrainBenchConfig, log: Log) -> dict[str, Any]:
    """`measure_column`, with out-of-memory and user errors turned into an error row, memory freed after. A
    `DataError` is raised: every column reads the same data, so it is the input's fault, not the column's."""
    error: Optional[str] = None
    try:
        row = measure_column(cfg, column, bench, log)
    except RuntimeError as e:
        error = as_oom(e)
    except DataError:
        raise
    except MoectlError as e:
        error = e.one_line()
    _free()  # after the except block: its traceback (and the tensors its frames hold) is gone
    if error is not None:
        log(f"{column.name}: {error}")
        return _error_row(column, error)
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """On every row: `ours_speedup`, ours' tokens/s over this row's (> 1: ours is faster), and `vs_first`, this
    row's tokens/s over the first column's (`--column adam --column muon`: Muon's fraction of Adam's speed)."""
    ours = next((r for r in rows if r["column"] == "ours" and r.get("tokens_per_s")), None)
    first = rows[0] if rows and rows[0].get("tokens_per_s") else None
    for r in rows:
        ok = ours is not None and r.get("tokens_per_s")
        r["ours_speedup"] = ours["tokens_per_s"] / r["tokens_per_s"] if ok else None  # type: ignore[index]
        ok = first is not None and r.get("tokens_per_s")
        r["vs_first"] = r["tokens_per_s"] / first["tokens_per_s"] if ok else None  # type: ignore[index]


def run(bench: TrainBenchConfig, configs: list[Config], meta: dict[str, Any], log: Log = lambda s: None) -> TrainBenchResult:
    """Measure every column (`configs[i]` is `bench.columns[i]`'s config); rows in column order."""
    result = TrainBenchResult(meta=meta)
    for column, cfg in zip(bench.columns, configs):
        result.rows.append(run_column(cfg, column, bench, log))
    add_ratios(result.rows)
    first = next((r for r in result.rows if "model" in r), None)
    if first is not None:
        meta["model"] = first["model"]
    for r in result.rows:
        if r.get("cuda_graph") and r.get("profile"):
            result.notes.append(f"{r['column']}: micro-batches replayed from a CUDA graph; the profiler sees the "
                                "replayed kernels without the ops that launched them, so its split by region is "
                                "not meaningful for this column (step time, tokens/s and memory are)")
        if r.get("losses") and first is not None and first.get("losses"):
            r["loss_vs_first_column"] = max(abs(a - b) for a, b in zip(r["losses"], first["losses"]))
            if not math.isfinite(r["loss_vs_first_column"]):
                result.notes.append(f"{r['column']}: non-finite loss")
    return result
