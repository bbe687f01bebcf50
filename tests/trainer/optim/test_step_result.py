"""The error a non-finite step raises names what was not finite (trainer/optim/step_result.py)."""

from __future__ import annotations

import math

from trainer.optim.step_result import NonFiniteGradError


def test_a_nonfinite_norm_names_the_gradient_a_finite_one_the_loss() -> None:
    """The verdict folds a non-finite grad and a non-finite step loss into one flag; a finite norm with the
    flag set can only come from the loss, and the message must not send the user after the gradients."""
    grad = NonFiniteGradError(math.inf, 7)
    assert "non-finite gradient" in str(grad) and "step 7" in str(grad) and "no update was applied" in str(grad)
    loss = NonFiniteGradError(1.25, 7)
    assert "non-finite loss" in str(loss) and "gradients were finite" in str(loss) and "1.25" in str(loss)
    assert "train.on_nonfinite=skip" in loss.fix and loss.grad_norm == 1.25 and loss.step == 7
