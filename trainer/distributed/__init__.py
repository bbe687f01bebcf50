"""Data and expert parallelism: process groups, contiguous param/grad buffers, buckets and bucket groups,
grad reduce and param gather with overlap hooks, and the param-sync state machine.

Start at `ddp.DistributedModel` (the wrapper a training loop uses) and `parallel_state.init_distributed`.
"""

from trainer.distributed.bucket_group import BucketGroup, GradSyncError
from trainer.distributed.buffers import BufferKey, ParamAndGradBuffer
from trainer.distributed.ddp import DEFAULT_OPTIMIZER_TAG, DistributedModel, is_expert_param
from trainer.distributed.param_storage import AliasedStagingStorage, HighPrecisionStorage, ParamStorage
from trainer.distributed.param_sync import ParamSyncError, ParamSyncState
from trainer.distributed.parallel_state import (
    Group,
    ParallelState,
    build_parallel_state,
    dense_seed,
    destroy_distributed,
    expert_seed,
    init_distributed,
)

__all__ = [
    "AliasedStagingStorage",
    "BucketGroup",
    "BufferKey",
    "DEFAULT_OPTIMIZER_TAG",
    "DistributedModel",
    "GradSyncError",
    "Group",
    "HighPrecisionStorage",
    "ParallelState",
    "ParamAndGradBuffer",
    "ParamStorage",
    "ParamSyncError",
    "ParamSyncState",
    "build_parallel_state",
    "dense_seed",
    "destroy_distributed",
    "expert_seed",
    "init_distributed",
    "is_expert_param",
]
