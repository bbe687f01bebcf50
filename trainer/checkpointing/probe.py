"""The probe loss of a set of model weights, as `ckpt validate` will recompute it for their checkpoint.

A checkpoint records the loss of one fixed batch (`Trainer.probe_loss`), and `ckpt validate` recomputes it
to catch weights edited together with their sha256. `import-hf` writes checkpoints without a training run,
so it asks this module (the engine side: `ckpt/` builds no models) for the loss of a model holding the
imported weights: built from the import's own config, loaded exactly as a model-only checkpoint loads
(`load_model_weights`), so validate's recomputation is bitwise the same number.
"""

from __future__ import annotations

import copy
import tempfile

import torch

from moectl.core.config.schema import Config
from trainer.checkpointing.resume import load_model_weights
from trainer.loop import Trainer
from trainer.observer import SilentObserver


def probe_loss_of_weights(cfg: Config, weights: dict[str, torch.Tensor]) -> float:
    """The probe loss of a model built from `cfg` holding `weights` (logical tensors in `cfg`'s layout).

    Builds a whole trainer (model, optimizer, data) on this process: it needs the memory a one-process
    `ckpt validate` of the checkpoint needs.
    """
    cfg = copy.deepcopy(cfg)
    cfg.checkpoint.load = None
    cfg.checkpoint.save_interval = None
    with tempfile.TemporaryDirectory(prefix="moectl-probe-") as run_dir:
        cfg.run_dir = run_dir  # never written: the trainer is not run
        trainer = Trainer(cfg, SilentObserver())
        load_model_weights(weights, cfg, trainer.model, trainer.engine, trainer.rt.pstate)
        return trainer.probe_loss()
