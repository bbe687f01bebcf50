import math

import pytest

from moectl.core.config.schema import OptimizerConfig
from trainer.optim.lr_schedule import lr_at


def cfg(**kw) -> OptimizerConfig:
    return OptimizerConfig(lr=1.0, min_lr=0.1, **kw)


def test_warmup_is_linear_and_nonzero_at_step_zero():
    c = cfg(lr_warmup_iters=4, lr_decay_style="constant")
    assert [lr_at(s, c, 100) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_decay_reaches_min_lr_at_end_and_stays(style):
    c = cfg(lr_warmup_iters=10, lr_decay_style=style)
    assert lr_at(10, c, 110) == pytest.approx(1.0)
    assert lr_at(110, c, 110) == pytest.approx(0.1)
    assert lr_at(500, c, 110) == pytest.approx(0.1)


def test_cosine_midpoint_and_linear_midpoint():
    assert lr_at(50, cfg(lr_decay_style="cosine"), 100) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_at(50, cfg(lr_decay_style="linear"), 100) == pytest.approx(0.55)


def test_lr_decay_iters_overrides_train_iters():
    c = cfg(lr_decay_style="linear", lr_decay_iters=20)
    assert lr_at(20, c, 100) == pytest.approx(0.1)
    assert lr_at(10, c, 100) == pytest.approx(0.55)
