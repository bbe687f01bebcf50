"""The weights' random init, and skipping it when a checkpoint will overwrite every value.

Weights are drawn on the CPU from `train.seed`'s own generator, so a model starts from the same values on
any device; for the reference model (1.83B params) that is 1.83B normal draws on one core, 7-10 s per rank.
A run that loads a checkpoint (`checkpoint.load`: a resume, `ckpt validate`) overwrites every trainable
param, and the load refuses a checkpoint that lacks one (`trainer/checkpointing/resume.py`), so inside
`skipped_init()` the draws are replaced by zeros: a memset, finite and the same on every rank (the values
pass through the replica broadcast and, under low-precision param gather, a first quantization before the
load replaces them). The generator is a private one, so skipping its draws changes no other random stream.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

_STATE = threading.local()


@contextmanager
def skipped_init() -> Iterator[None]:
    """Inside: `normal_` fills zeros instead of drawing (for a model whose values a checkpoint replaces)."""
    before = getattr(_STATE, "skip", False)
    _STATE.skip = True
    try:
        yield
    finally:
        _STATE.skip = before


def init_skipped() -> bool:
    return bool(getattr(_STATE, "skip", False))


def normal_(t: torch.Tensor, std: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    """`t.normal_(0, std, generator=generator)`, or zeros inside `skipped_init()`; returns `t`."""
    if init_skipped():
        return t.zero_()
    return t.normal_(0.0, std, generator=generator)
