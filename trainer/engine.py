"""The optimizer side of a training step, behind one small interface the loop and checkpoints call.

`LocalEngine` is the one-device engine: `torch.optim.AdamW` (or SGD) over fp32 params, global-norm
clipping, a non-finite guard. The distributed engine (`trainer.distributed`) offers the same methods,
so `trainer.loop` and `trainer.checkpointing` do not know which one they drive.

Checkpoints see an engine's state as logical entries per param name (this rank's experts, unsharded):
`{"param": the weight a high-precision run holds, "master": fp32, <moment>: fp32, ...}`, the moments being
`state_keys(name)` minus "master".
"""

from __future__ import annotations

import contextlib
import math
from typing import Protocol

import torch
from torch import nn

from moectl.core.config.schema import OptimizerConfig
from moectl.core.errors import MoectlError
from trainer.optim.distributed_optimizer import decays
from trainer.optim.step_result import StepResult

__all__ = ["Engine", "LocalEngine", "StepResult", "param_groups"]


class Engine(Protocol):
    """What the loop needs from the optimizer side."""

    def zero_grad(self) -> None: ...

    def micro_batch(self, is_last: bool) -> contextlib.AbstractContextManager[None]: ...

    def step(self, lr: float) -> StepResult: ...

    def sync_params_for_eval(self) -> None: ...

    @property
    def step_count(self) -> int:
        """Optimizer updates applied so far (skipped steps not counted)."""
        ...

    def state_keys(self, name: str) -> tuple[str, ...]:
        """The logical state of param `name`: "master" and the optimizer's moments for it."""
        ...

    def logical_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every local param's logical entries (see the module docstring), after finishing any deferred
        param gather. A collective: every rank calls it."""
        ...

    def load_logical_state(self, params: dict[str, dict[str, torch.Tensor]], step: int | None) -> None:
        """Take masters (and moments where given, and the step count unless None); the params then equal
        the masters. A collective under data parallelism."""
        ...


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups with the distributed optimizer's decay rule (matrices yes; norms and biases no)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class LocalEngine:
    """One device, fp32 params: torch's AdamW/SGD, global-norm clipping, non-finite guard."""

    def __init__(self, model: nn.Module, cfg: OptimizerConfig) -> None:
        self.model, self.cfg = model, cfg
        self._steps = 0
        groups = param_groups(model, cfg.weight_decay)
        if cfg.optimizer == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(groups, lr=cfg.lr)
        elif cfg.optimizer == "adam":
            self.optimizer = torch.optim.AdamW(
                groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps
            )
        else:
            raise MoectlError(
                f"optimizer.optimizer={cfg.optimizer!r} needs the distributed optimizer engine",
                "set optimizer.optimizer=adam for a single-device run",
            )

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def micro_batch(self, is_last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def step(self, lr: float) -> StepResult:
        """Clip and step; a non-finite grad norm leaves params and optimizer state untouched."""
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        max_norm = self.cfg.clip_grad if self.cfg.clip_grad > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not math.isfinite(norm):
            return StepResult(norm, skipped=True)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self._steps += 1
        return StepResult(norm, skipped=False)

    def sync_params_for_eval(self) -> None:
        """Nothing to gather on one device."""

    @property
    def step_count(self) -> int:
        return self._steps

    def state_keys(self, name: str) -> tuple[str, ...]:
        """fp32 params are their own masters; torch's optimizer state is not checkpointed (SGD has none)."""
        return ("master",)

    def logical_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {n: {"param": p.detach(), "master": p.detach().float()} for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def load_logical_state(self, params: dict[str, dict[str, torch.Tensor]], step: int | None) -> None:
        for n, p in self.model.named_parameters():
            p.copy_(params[n]["master"])
        if step is not None:
            self._steps = step
