"""Out-of-memory as a benchmark result: a shape or column that does not fit is reported, never a traceback.

Catch `RuntimeError` around the work and keep `as_oom(e)` for the row (it raises again whatever is not an
allocation failure: CUDA's `torch.OutOfMemoryError`, or the CPU allocator's, which torch raises as a plain
RuntimeError), then call `free(device)` after the `except` block has ended (inside it the traceback still
holds the frames, and with them the tensors that filled the memory).
"""

from __future__ import annotations

import gc

import torch

_CPU_OOM = "DefaultCPUAllocator: can't allocate memory"


def is_oom(e: BaseException) -> bool:
    """Whether `e` is an allocation failure: CUDA's out-of-memory error or the CPU allocator's."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and _CPU_OOM in str(e))


def as_oom(e: RuntimeError) -> str:
    """`oom_message(e)` for an allocation failure (`is_oom`); any other error is raised again, unchanged."""
    if not is_oom(e):
        raise e
    return oom_message(e)


def oom_message(e: BaseException) -> str:
    """'out of memory: <the allocator's first line>', short enough for a table cell's note."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if _CPU_OOM in first:  # "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: ..."
        first = first[first.index(_CPU_OOM):]
    return "out of memory: " + first[:200]


def free(device: torch.device | str) -> None:
    """Return what the failed work held: collect its garbage and empty the CUDA caching allocator."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
