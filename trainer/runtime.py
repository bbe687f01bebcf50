"""Where a run executes: device choice, seeds and determinism, this process's rank.

Rank information comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); a plain
`moectl train` is rank 0 of 1. Process groups themselves are built by `trainer.distributed`.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch

from moectl.core.config.schema import ParallelConfig, TrainConfig
from moectl.core.errors import UsageError
from trainer.parallel.groups import ParallelState, init_distributed


@dataclass(frozen=True)
class Runtime:
    """This process's device and place in the world."""

    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    pstate: ParallelState

    @property
    def is_main(self) -> bool:
        """Rank 0 prints, writes metrics and commits checkpoints."""
        return self.rank == 0


def pick_device(choice: str, local_rank: int) -> torch.device:
    """`auto` -> this process's GPU when CUDA is available, else the CPU."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UsageError("train.device='cuda' but no CUDA device is visible", "set train.device=auto or cpu")
        count = torch.cuda.device_count()
        if local_rank >= count:  # more processes on this host than GPUs: CUDA's "invalid device ordinal" otherwise
            raise UsageError(f"train.device={choice!r}: local rank {local_rank} needs GPU {local_rank}, but this host "
                             f"shows {count} GPU{'s' if count != 1 else ''}",
                             f"launch at most {count} process{'es' if count != 1 else ''} per node "
                             f"(--nproc-per-node {count}), or set train.device=cpu")  # fmt: skip
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def set_determinism(seed: int, deterministic: bool) -> None:
    """Seed every RNG; with `deterministic`, also force deterministic kernels (bit-identical reruns)."""
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; must be set before the first GEMM.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"
#: torch's pinned host allocator: map the pages on 8 threads, then `cudaHostRegister` them, instead of one
#: `cudaHostAlloc` that locks page by page. On an H100 host: 6 GiB 3.21 -> 1.07 s, 48 x 128 MiB 3.39 ->
#: 0.77 s, device-to-host copies into it unchanged (~50 GiB/s) (docs/benchmarks.md). What a background
#: save's first host buffers cost (ckpt/staging.py), and what training blocks on.
FAST_PINNING = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def prefer_fast_pinning(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> bool:
    """Add `FAST_PINNING` to `PYTORCH_CUDA_ALLOC_CONF` unless the user set pinned-memory keys there; True when
    added. torch reads the variable when CUDA's allocator config is first used, so call it before that."""
    current = environ.get(ALLOC_ENV, "")
    if "pinned_" in current:
        return False
    environ[ALLOC_ENV] = f"{current},{FAST_PINNING}" if current.strip() else FAST_PINNING
    return True


def setup_runtime(cfg: TrainConfig, parallel: ParallelConfig) -> Runtime:
    """Read torchrun's environment, choose the device, join the process groups (world > 1), seed."""
    prefer_fast_pinning()  # before the first CUDA allocation reads the allocator's config
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(cfg.device, local_rank)
    pstate = init_distributed(parallel, device=device)
    set_determinism(cfg.seed, cfg.deterministic)
    return Runtime(device=device, rank=rank, world_size=world, local_rank=local_rank, pstate=pstate)
