"""Data parallelism around the single-device model: contiguous param/grad buffers, buckets and bucket
groups, grad reduce and param gather with overlap hooks, and the param-sync state machine.

Start at `ddp.DistributedModel` (the wrapper a training loop uses). Process groups and the collectives
themselves are one layer down, in `trainer.parallel` (the MoE layer's expert parallelism uses them too).
"""

from trainer.distributed.bucket_group import BucketGroup, GradSyncError
from trainer.distributed.buffers import BufferKey, ParamAndGradBuffer
from trainer.distributed.ddp import DEFAULT_OPTIMIZER_TAG, DistributedModel, is_expert_param
from trainer.distributed.param_storage import AliasedStagingStorage, HighPrecisionStorage, ParamStorage
from trainer.distributed.param_sync import ParamSyncError, ParamSyncState

__all__ = [
    "AliasedStagingStorage",
    "BucketGroup",
    "BufferKey",
    "DEFAULT_OPTIMIZER_TAG",
    "DistributedModel",
    "GradSyncError",
    "HighPrecisionStorage",
    "ParamAndGradBuffer",
    "ParamStorage",
    "ParamSyncError",
    "ParamSyncState",
    "is_expert_param",
]
