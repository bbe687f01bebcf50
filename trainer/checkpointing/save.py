"""Save a live run: the engine's logical state -> this rank's files -> the multi-rank commit of `ckpt.save`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from ckpt.host_copy import on_host
from ckpt.logical import flatten_state, globalize, rank_files, training_meta
from ckpt.save import save_checkpoint
from ckpt.staging import Files
from moectl.core.config.schema import Config
from trainer.checkpointing.scaling_state import META_KEY as SCALING_KEY, export_scaling
from trainer.parallel.groups import ParallelState
from trainer.engine.protocol import Engine


def checkpoint_parts(step: int, cfg: Config, engine: Engine, pstate: Optional[ParallelState], probe_loss: float,
                     carried: Optional[dict[str, Any]] = None) -> tuple[Files, dict[str, Any]]:
    """What this rank saves after `step` steps: its files (`{file name: {tensor name: tensor}}`, only the
    logical tensors this rank writes) and the manifest meta. Collective: every rank calls it. The tensors
    may alias live state (params, masters): write them before training goes on, or copy them first."""
    local = flatten_state(engine.logical_state())
    tensors = globalize(local, pstate.ep if pstate is not None else None, cfg.moe.num_experts)
    world = pstate.world_size if pstate is not None else 1
    rank = pstate.rank if pstate is not None else 0
    meta = training_meta(cfg, step, tensors, world, probe_loss, optimizer_step=engine.step_count, carried=carried)
    scaling = export_scaling(engine.model, pstate)  # delayed scaling's windows (collective)
    if scaling is not None:
        meta[SCALING_KEY] = scaling
    return rank_files(tensors, rank, world), meta


def save_training_checkpoint(root: Path, step: int, cfg: Config, engine: Engine, pstate: Optional[ParallelState],
                             probe_loss: float, carried: Optional[dict[str, Any]] = None,
                             phases: Optional[dict[str, float]] = None) -> Path:
    """Save the state after `step` steps under `root`, collectively (every rank calls this); returns the
    committed step folder. `carried`: meta the loaded checkpoint passed on (`Restored.carried`); `phases`:
    receives this rank's seconds per part of the save (`ckpt.save.PHASES`, plus `gather_s`: collecting the
    logical state; `prepare_s` includes the copy to the host, `ckpt.host_copy.on_host`)."""
    t0 = time.perf_counter()
    files, meta = checkpoint_parts(step, cfg, engine, pstate, probe_loss, carried)
    gather_s = time.perf_counter() - t0
    world = pstate.world_size if pstate is not None else 1
    group = pstate.dp.pg if pstate is not None and world > 1 else None
    t1 = time.perf_counter()
    with on_host(files) as staged:  # on CUDA: one page-locked copy of the share (ckpt/host_copy.py)
        copy_s = time.perf_counter() - t1
        path = save_checkpoint(root, step, staged, meta, group=group, keep_last=cfg.checkpoint.keep_last,
                               phases=phases)  # fmt: skip
        del staged
    if phases is not None:
        phases["gather_s"] = gather_s
        phases["prepare_s"] += copy_s
    return path
