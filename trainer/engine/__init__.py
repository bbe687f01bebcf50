"""The optimizer side of a training step, behind one interface (`Engine`) the loop and checkpoints call.

`protocol.py` says what an engine does; `local.py` is the one-device engine (torch's optimizers),
`distributed.py` the data-parallel one (contiguous buffers, sharded AdamW or layer-wise Muon). The loop
and `trainer.checkpointing` never know which one they drive.
"""

from trainer.engine.distributed import DistributedEngine
from trainer.engine.local import LocalEngine, param_groups
from trainer.engine.protocol import Engine
from trainer.optim.step_result import StepResult

__all__ = ["DistributedEngine", "Engine", "LocalEngine", "StepResult", "param_groups"]
