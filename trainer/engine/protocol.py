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
        """Launch every grad reduction not launched yet: after a step of CUDA graph replays that did not hold
        them (`reduces_in_graph` false, so every micro-batch ran under `micro_batch(is_last=False)`)."""
        ...

    @property
    def reduces_in_graph(self) -> bool:
        """Whether the last micro-batch's CUDA graph holds the grad reductions: captured under
        `micro_batch(is_last=True)` with `finish_grad_sync` at its end, and `grads_reduced_by_replay` after
        each replay. False where nothing is reduced (one rank)."""
        ...

    def finish_grad_sync(self) -> None:
        """Launch what is left and wait for every grad reduction (on the stream: capturable)."""
        ...

    @property
    def grads_final_after_backward(self) -> bool:
        """Whether the grads the optimizer's norm reads are exactly what the last micro-batch's backward left in
        the grad buffers (no reduce, no scale in between: one data-parallel rank), so that backward may leave
        their sums of squares for the norm (`trainer/grad_sq.py`)."""
        ...

    def grads_reduced_by_replay(self) -> None:
        """Record that a replay of the last micro-batch's graph reduced every grad (no Python ran in it)."""
        ...

    @property
    def gathers_in_graph(self) -> bool:
        """Whether the first micro-batch's CUDA graph holds the param gathers (launched by its forward's
        pre-hooks): `stage_for_graph_gather` before each of its replays, `params_gathered_by_replay` after."""
        ...

    def stage_for_graph_gather(self) -> None:
        """Stage every param group not staged, so the gathering graph (or its capture) ships every group."""
        ...

    def params_gathered_by_replay(self) -> None:
        """Record that a replay of the first micro-batch's graph gathered every param group."""
        ...

    def step(self, lr: float, loss: torch.Tensor | None = None) -> StepResult:
        """Clip and update; a non-finite grad norm or `loss` (this rank's, on the device) skips the update on every
        rank. The host may queue the update before it knows either."""
        ...

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
