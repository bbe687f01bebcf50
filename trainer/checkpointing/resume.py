"""Resume a run: a checkpoint's logical tensors, normalised to this model's layout -> this rank's engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ckpt.logical import STATE_SUFFIX, check_architecture, localize, read_logical, restore_rng
from ckpt.reader import open_checkpoint
from moectl.core.config.schema import Config
from moectl.core.errors import CheckpointError
from trainer.parallel.groups import ParallelState
from trainer.engine.protocol import Engine


@dataclass
class Restored:
    """Where a resumed run continues."""

    step: int
    consumed_samples: int
    path: Path
    optimizer_state: bool  # moments and step count came from the checkpoint


def load_training_checkpoint(path: str | Path, cfg: Config, model: nn.Module, engine: Engine,
                             pstate: Optional[ParallelState]) -> Restored:
    """Restore model, masters and (unless `checkpoint.no_load_optim`) moments; return where to resume.

    - default: masters and moments from the checkpoint; params rebuilt from the masters;
    - `no_load_optim` + `load_main_params_from_ckpt`: masters from the checkpoint, fresh moments;
    - `no_load_optim` alone: masters from the checkpoint's model weights (what Megatron does), fresh moments.
    """
    ck = open_checkpoint(path, verify=True)
    check_architecture(ck.meta.get("config", {}), cfg)
    local_names = {n for n, _ in model.named_parameters()}
    logical = read_logical(ck, cfg, wanted=local_names)
    tensors = localize(logical, pstate.ep if pstate is not None else None, cfg.moe.num_experts, local_names)
    ccfg = cfg.checkpoint
    load_optim = not ccfg.no_load_optim
    masters_from_ckpt = load_optim or ccfg.load_main_params_from_ckpt
    params: dict[str, dict[str, torch.Tensor]] = {}
    missing = []
    for name in sorted(local_names):
        entry = {}
        master = tensors.get(name + STATE_SUFFIX["master"]) if masters_from_ckpt else tensors.get(name)
        if master is None:
            missing.append(name + (STATE_SUFFIX["master"] if masters_from_ckpt else ""))
            continue
        if masters_from_ckpt and master.dtype != torch.float32:
            raise CheckpointError(
                f"tensor {name}.main_param is {master.dtype}, not float32: loading it would narrow the fp32 master",
                "load a checkpoint written by moectl train (fp32 masters), or set checkpoint.no_load_optim=true",
            )
        entry["master"] = master.float()
        if load_optim:
            for key in engine.state_keys(name):
                t = tensors.get(name + STATE_SUFFIX[key])
                if t is None:
                    missing.append(name + STATE_SUFFIX[key])
                else:
                    entry[key] = t
        params[name] = entry
    if missing:
        raise CheckpointError(
            f"checkpoint {ck.path} lacks {len(missing)} tensor(s) this model needs: {', '.join(missing[:5])}"
            + (" ..." if len(missing) > 5 else ""),
            "load a checkpoint of this model, or set checkpoint.no_load_optim=true to skip optimizer state",
        )
    step = int(ck.meta.get("train_state", {}).get("optimizer_step", ck.step)) if load_optim else None
    engine.load_logical_state(params, step=step)
    restore_rng(ck.meta)
    return Restored(step=ck.step, consumed_samples=int(ck.meta.get("consumed_samples", 0)), path=ck.path,
                    optimizer_state=load_optim)
