"""Resume a run: a checkpoint's logical tensors, normalised to this model's layout -> this rank's engine."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ckpt.logical import (
    STATE_SUFFIX, carried_meta, check_architecture, is_model_only, localize, read_logical, restore_rng,
)  # fmt: skip
from ckpt.reader import Checkpoint, open_checkpoint
from moectl.core.config.schema import Config
from moectl.core.facts import GLU_ROWS_ATTR, QKV_ROWS_ATTR
from moectl.core.errors import CheckpointError, ConfigError
from moectl.core.rules import fmt
from trainer.checkpointing.scaling_state import restore_scaling
from trainer.parallel.groups import ParallelState
from trainer.engine.protocol import Engine


@dataclass
class Restored:
    """Where a resumed run continues."""

    step: int
    consumed_samples: int
    path: Path
    optimizer_state: bool  # moments and step count came from the checkpoint
    carried: dict[str, Any] = field(default_factory=dict)  # meta every later save keeps (`hf`: an import's origin)


def load_training_checkpoint(path: str | Path, cfg: Config, model: nn.Module, engine: Engine,
                             pstate: Optional[ParallelState], verify: bool = True) -> Restored:
    """Restore model, masters and (unless `checkpoint.no_load_optim`) moments; return where to resume.

    - default: masters and moments from the checkpoint; params rebuilt from the masters;
    - `no_load_optim` + `load_main_params_from_ckpt`: masters from the checkpoint, fresh moments;
    - `no_load_optim` alone: masters from the checkpoint's model weights (what Megatron does), fresh moments.
    A model-only checkpoint (no optimizer tensors at all: `import-hf` writes those) loads as with
    `no_load_optim`, since there is nothing else to load; asking for its masters is still an error.
    Optimizer state saved by another optimizer than `cfg`'s is refused (`check_optimizer`), never dropped or
    half-loaded: `no_load_optim` starts the config's optimizer fresh from the checkpoint's weights.
    `verify=False` skips hashing the files (the manifest and its seal are still checked): only for a caller
    that verifies them itself and discards this load if they fail (`ckpt validate` does, alongside).
    """
    ck = open_checkpoint(path, verify=verify)
    check_architecture(ck.meta.get("config", {}), cfg)
    ccfg = cfg.checkpoint
    load_optim = not ccfg.no_load_optim and not is_model_only(ck)
    if load_optim:
        check_optimizer(ck, cfg)
        warn_changed_muon_splits(ck, cfg, model)
    local = dict(model.named_parameters())
    local_names = set(local)
    logical = read_logical(ck, cfg, wanted=local_names)
    tensors = localize(logical, pstate.ep if pstate is not None else None, cfg.moe.num_experts, local_names)
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
        _check_shapes(ck.path, name, entry, tuple(local[name].shape), masters_from_ckpt)
    if missing:
        raise CheckpointError(
            f"checkpoint {ck.path} lacks {len(missing)} tensor(s) this model needs: {', '.join(missing[:5])}"
            + (" ..." if len(missing) > 5 else ""),
            "load a checkpoint of this model, or set checkpoint.no_load_optim=true to skip optimizer state",
        )
    step = int(ck.meta.get("train_state", {}).get("optimizer_step", ck.step)) if load_optim else None
    # The fp8 windows are the model's quantizers' state, restored with any load (TE loads its fp8 meta with the
    # module); before the masters: loading stages them, which reads the windows (scaling_state.py)
    restore_scaling(model, ck.meta, pstate, masters_restored=masters_from_ckpt)
    engine.load_logical_state(params, step=step)
    restore_rng(ck.meta)
    return Restored(step=ck.step, consumed_samples=int(ck.meta.get("consumed_samples", 0)), path=ck.path,
                    optimizer_state=load_optim, carried=carried_meta(ck.meta))


def _recorded_optimizer(ck: Checkpoint) -> dict[str, Any]:
    """The checkpoint's recorded `optimizer` config section ({} when it records none)."""
    opt = ck.meta.get("config", {}).get("optimizer")
    return opt if isinstance(opt, dict) else {}


def saved_optimizer(ck: Checkpoint) -> Optional[str]:
    """The optimizer the checkpoint's run used, per its recorded config (None when it records none)."""
    name = _recorded_optimizer(ck).get("optimizer")
    return name if isinstance(name, str) else None


def check_optimizer(ck: Checkpoint, cfg: Config) -> None:
    """Refuse to load the optimizer state of a checkpoint saved by another optimizer than `cfg`'s: its moments do
    not fit (or, for sgd, would be dropped without a word)."""
    saved, wanted = saved_optimizer(ck), cfg.optimizer.optimizer
    if saved is None or saved == wanted:
        return
    raise ConfigError(
        "optimizer.optimizer", wanted,
        f"checkpoint {ck.path} holds the state of optimizer {saved}, not {wanted}: it cannot resume {wanted}",
        f"set checkpoint.no_load_optim=true to start {wanted} fresh from the checkpoint's weights, or "
        f"optimizer.optimizer={saved} to resume the checkpoint's optimizer",
    )


#: Muon options that change its update, introduced after checkpoints existed: absent from a recorded config, the
#: saved run had the behaviour the option's `false` keeps
MUON_SPLITS = {"muon_split_glu": GLU_ROWS_ATTR, "muon_split_qkv": QKV_ROWS_ATTR}  # the option: its weights' mark


def warn_changed_muon_splits(ck: Checkpoint, cfg: Config, model: Optional[nn.Module] = None) -> None:
    """Warn (on rank 0) when a Muon run resumes with another `optimizer.muon_split_*` than the checkpoint's run
    trained with (a checkpoint saved before the option existed trained with it off): the momentum loads as
    saved, but the orthogonalised updates of those weights change from what the saved run would have done next.
    Only for a split `model` has weights of (a model without gated fc1 splits nothing by `muon_split_glu`)."""
    if cfg.optimizer.optimizer != "muon" or saved_optimizer(ck) not in (None, "muon"):
        return
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    recorded = _recorded_optimizer(ck)
    for key, attr in MUON_SPLITS.items():
        saved, now = recorded.get(key, False), getattr(cfg.optimizer, key)
        if model is not None and not any(getattr(p, attr, None) is not None for p in model.parameters()):
            continue
        if saved != now:
            when = "" if key in recorded else " (it was saved before the option existed)"
            warnings.warn(f"checkpoint {ck.path} trained with optimizer.{key}={fmt(saved)}{when}; this run resumes "
                          f"with {fmt(now)}, so Muon's updates of those weights change from the saved run's: set "
                          f"optimizer.{key}={fmt(saved)} to continue as it trained", UserWarning, stacklevel=2)


def _check_shapes(ck_path: Path, name: str, entry: dict[str, torch.Tensor], shape: tuple[int, ...],
                  masters_from_ckpt: bool) -> None:
    """Refuse, naming the tensor, a checkpoint tensor whose shape is not its param's (`check_architecture` passed,
    so the checkpoint's recorded config describes this model: its tensors contradict that config)."""
    for key, t in entry.items():
        if tuple(t.shape) != shape:
            saved = name + (STATE_SUFFIX[key] if key != "master" or masters_from_ckpt else "")
            raise CheckpointError(
                f"checkpoint {ck_path} tensor {saved!r} is {list(t.shape)}, but its recorded config builds {name} as "
                f"{list(shape)}: the config does not describe the saved tensors",
                f"its manifest.json's config was changed after the save (or written wrong); load another step, or "
                f"compare its config with its tensors: `moectl ckpt inspect {ck_path}`",
            )


def load_model_weights(weights: dict[str, torch.Tensor], cfg: Config, model: nn.Module, engine: Engine,
                       pstate: Optional[ParallelState]) -> None:
    """Set a built model to `weights` (logical model tensors in `cfg`'s expert layout and interleave) exactly as
    loading a model-only checkpoint of them would: fp32 masters from the weights, fresh optimizer state."""
    local_names = {n for n, _ in model.named_parameters()}
    tensors = localize(weights, pstate.ep if pstate is not None else None, cfg.moe.num_experts, local_names)
    missing = sorted(local_names - set(tensors))
    if missing:
        raise CheckpointError(f"the weights lack {len(missing)} tensor(s) this model needs: {', '.join(missing[:5])}",
                              "give every model tensor")  # fmt: skip
    engine.load_logical_state({n: {"master": tensors[n].float()} for n in sorted(local_names)}, step=None)
