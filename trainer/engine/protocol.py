"""What the loop and checkpoints need from the optimizer side of a step: the `Engine` protocol.

Checkpoints see an engine's state as logical entries per param name (this rank's experts, unsharded):
`{"param": the weight a high-precision run holds, "master": fp32, <moment>: fp32, ...}`, the moments being
`state_keys(name)` minus "master".
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from torch import nn

from trainer.optim.step_result import StepResult


class Engine(Protocol):
    """What the loop and checkpoints need from the optimizer side."""

    @property
    def model(self) -> nn.Module:
        """The single-device model it trains (checkpoints read its fp8 scaling windows there)."""
        ...

    def zero_grad(self) -> None: ...

    def micro_batch(self, is_last: bool) -> contextlib.AbstractContextManager[None]: ...

    def start_grad_sync(self) -> None:
        """Launch every grad reduction not launched yet (after micro-batches replayed from a CUDA graph, which
        run under `micro_batch(is_last=False)` so no grad collective is captured; an ep all-to-all is)."""
        ...

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
