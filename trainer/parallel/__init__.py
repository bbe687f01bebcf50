"""Process groups (data, expert, expert-data parallel) and the few collectives built on them.

The lowest distributed layer: the MoE layer's expert parallelism, the data-parallel wrapper
(`trainer.distributed`) and the optimizers all stand on it; it imports nothing else of the engine.
"""

from trainer.parallel.groups import (
    Group,
    ParallelState,
    build_parallel_state,
    dense_seed,
    destroy_distributed,
    expert_seed,
    init_distributed,
)

__all__ = [
    "Group",
    "ParallelState",
    "build_parallel_state",
    "dense_seed",
    "destroy_distributed",
    "expert_seed",
    "init_distributed",
]
