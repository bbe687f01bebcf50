"""The engine's side of checkpoints: save a live run, resume one, prove a checkpoint restores.

The format (names, files, manifest, layouts) is `ckpt/`, which knows nothing of the engine; these modules
hand it the logical state the engine declares (`Engine.logical_state` / `load_logical_state` /
`step_count`, trainer/engine.py) and build live models to validate against.
"""

from trainer.checkpointing.resume import Restored, load_training_checkpoint
from trainer.checkpointing.save import save_training_checkpoint

__all__ = ["Restored", "load_training_checkpoint", "save_training_checkpoint"]
