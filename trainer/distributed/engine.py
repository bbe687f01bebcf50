"""`DistributedEngine`: the loop's `Engine` (see `trainer/engine.py`) over DistributedModel + DistributedOptimizer.

It wraps the single-device model in place (buffers, hooks), broadcasts dp replicas' params from their
first rank, and builds the AdamW `DistributedOptimizer` on the "adam" tag. The loop keeps calling the
model itself (`model.loss(...)`): the wrapper's hooks live on the model's modules. Per step:

    engine.zero_grad()                          -> zero_grad_buffer (re-stages aliased staging)
    with engine.micro_batch(is_last=...): ...   -> no_sync() on all micro-batches but the last
    engine.step(lr)                             -> finish_grad_sync, then optimizer.step
    engine.sync_params_for_eval()               -> force_param_sync (eval, checkpoint, exit)
"""

from __future__ import annotations

import contextlib
from typing import Literal

from torch import nn

from moectl.config.schema import OptimizerConfig, ParallelConfig
from moectl.errors import ConfigError
from trainer.distributed.ddp import DistributedModel, StorageSpec
from trainer.distributed.parallel_state import ParallelState
from trainer.optim.distributed_optimizer import DistributedOptimizer
from trainer.optim.step_result import StepResult


class DistributedEngine:
    def __init__(self, model: nn.Module, parallel_cfg: ParallelConfig, optimizer_cfg: OptimizerConfig,
                 pstate: ParallelState, on_nonfinite: Literal["stop", "skip"] = "stop",
                 storage: StorageSpec = None) -> None:
        if optimizer_cfg.optimizer != "adam":
            raise ConfigError("optimizer.optimizer", optimizer_cfg.optimizer,
                              "the distributed engine implements AdamW only so far", fix="set optimizer.optimizer=adam")
        self.dmodel = DistributedModel(model, parallel_cfg, pstate, storage=storage)
        self.dmodel.broadcast_params()
        self.optimizer = DistributedOptimizer(self.dmodel, optimizer_cfg, on_nonfinite=on_nonfinite)

    def zero_grad(self) -> None:
        self.dmodel.zero_grad_buffer()

    def micro_batch(self, is_last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if is_last else self.dmodel.no_sync()

    def step(self, lr: float) -> StepResult:
        self.dmodel.finish_grad_sync()
        return self.optimizer.step(lr)

    def sync_params_for_eval(self) -> None:
        self.dmodel.force_param_sync()
