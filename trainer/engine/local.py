"""`LocalEngine`: one device, fp32 params, torch's AdamW/SGD, global-norm clipping, a non-finite guard."""

from __future__ import annotations

import contextlib
import math
from typing import Literal

import torch
from torch import nn

from moectl.core.config.schema import OptimizerConfig
from moectl.core.errors import MoectlError
from trainer import grad_sq
from trainer.moe import wgrad_deferral
from trainer.optim.distributed_optimizer import decays
from trainer.optim.step_result import NonFiniteGradError, StepResult


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups with the distributed optimizer's decay rule (matrices yes; norms and biases no)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class LocalEngine:
    """One device, fp32 params: torch's AdamW/SGD, global-norm clipping, non-finite guard."""

    def __init__(self, model: nn.Module, cfg: OptimizerConfig,
                 on_nonfinite: Literal["stop", "skip"] = "stop") -> None:  # fmt: skip
        self.model, self.cfg, self.on_nonfinite = model, cfg, on_nonfinite
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
        grad_sq.clear()  # nothing records here today (no main_grad), but no record may outlive its grads
        wgrad_deferral.clear_all()

    def micro_batch(self, is_last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def start_grad_sync(self) -> None:
        """One device: nothing to reduce."""

    @property
    def reduces_in_graph(self) -> bool:
        return False

    def finish_grad_sync(self) -> None:
        """One device: nothing to reduce."""

    @property
    def grads_final_after_backward(self) -> bool:
        """torch's optimizer and norm read `.grad`, not the grad buffers the fused layers could account for."""
        return False

    def grads_reduced_by_replay(self) -> None:
        """One device: nothing to reduce."""

    @property
    def gathers_in_graph(self) -> bool:
        return False

    def stage_for_graph_gather(self) -> None:
        """One device: nothing to gather."""

    def params_gathered_by_replay(self) -> None:
        """One device: nothing to gather."""

    def step(self, lr: float, loss: torch.Tensor | None = None) -> StepResult:
        """Clip and step; a non-finite grad norm or `loss` leaves params and optimizer state untouched, and under
        `on_nonfinite: stop` raises `NonFiniteGradError` (as the distributed optimizers do)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        max_norm = self.cfg.clip_grad if self.cfg.clip_grad > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not math.isfinite(norm) or (loss is not None and not bool(torch.isfinite(loss).all())):
            if self.on_nonfinite == "stop":
                raise NonFiniteGradError(norm, self._steps + 1)
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
