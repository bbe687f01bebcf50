"""What an optimizer step did, and the error a non-finite step raises under `on_nonfinite: stop`.

`StepResult` has the fields of `trainer.engine.StepResult` (the loop reads `grad_norm` and `skipped`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moectl.core.errors import MoectlError


@dataclass(frozen=True)
class StepResult:
    """The global grad norm before clipping (the same on every rank), and whether the update was skipped."""

    grad_norm: float
    skipped: bool


class NonFiniteGradError(MoectlError):
    """A non-finite grad or step loss (on any rank) under `train.on_nonfinite: stop`; raised on every rank, before
    any update. The verdict folds both into one flag (`grad_norm.global_grad_verdict`): a finite norm with the
    flag set means the loss was the non-finite one, and the message says so."""

    def __init__(self, grad_norm: float, step: int) -> None:
        what = "gradient" if not math.isfinite(grad_norm) else "loss (the gradients were finite)"
        super().__init__(
            f"non-finite {what}, global grad norm {grad_norm}, at optimizer step {step}; no update was applied",
            "lower optimizer.lr or raise optimizer.lr_warmup_iters, or set train.on_nonfinite=skip",
        )
        self.grad_norm = grad_norm
        self.step = step
