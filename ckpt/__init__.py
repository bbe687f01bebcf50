"""moectl checkpoints: the on-disk format (docs/checkpoint.md) and its storage layer.

    checkpoints/step_00000100/{model,optim}-NNNNN.safetensors + manifest.json (written last)
    checkpoints/latest          (the newest committed step's folder name, replaced atomically)

Modules, one concept each: `names` (what a name means), `durable` (fsync/atomic replace), `shards`
(one safetensors file), `st_layout` (where its bytes go, as safetensors writes them), `shard_io` (parallel
writes and hashes, overlapped reads), `st_header` (our own header checks), `manifest` (the JSON schema),
`collective` (pickle-free gather/broadcast), `faults` (test fault injection), `save` (the multi-rank
commit protocol), `staging` (host copies for a background save), `async_save` (the writer thread),
`discovery` (which step to load), `retention`, `integrity` (verify), `reader` (load).
"""

from ckpt.discovery import find_latest, list_committed, list_uncommitted, resolve_load_path
from ckpt.integrity import verify_checkpoint
from ckpt.problems import Problem
from ckpt.reader import Checkpoint, TensorInfo, open_checkpoint
from ckpt.retention import apply_retention
from ckpt.save import CheckpointSaveError, save_checkpoint

__all__ = [
    "Checkpoint",
    "CheckpointSaveError",
    "Problem",
    "TensorInfo",
    "apply_retention",
    "find_latest",
    "list_committed",
    "list_uncommitted",
    "open_checkpoint",
    "resolve_load_path",
    "save_checkpoint",
    "verify_checkpoint",
]
