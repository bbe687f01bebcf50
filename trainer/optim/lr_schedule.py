"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to `min_lr`.

A pure function of the step, so a resumed run needs no scheduler state beyond the step itself.
Megatron's convention: step 0 of warmup already has a non-zero LR (lr * 1 / warmup).
"""

from __future__ import annotations

import math

from moectl.core.config.schema import OptimizerConfig


def lr_at(step: int, cfg: OptimizerConfig, train_iters: int) -> float:
    """The learning rate for optimizer step `step` (0-based) of a run of `train_iters` steps."""
    warmup = cfg.lr_warmup_iters
    if warmup > 0 and step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    decay_iters = (cfg.lr_decay_iters or train_iters) - warmup
    if decay_iters <= 0:
        return cfg.lr
    progress = min(max(step - warmup, 0) / decay_iters, 1.0)
    if cfg.lr_decay_style == "linear":
        coeff = 1.0 - progress
    else:  # cosine
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * coeff
