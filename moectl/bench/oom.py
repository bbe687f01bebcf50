"""Out-of-memory as a benchmark result: a shape or column that does not fit is reported, never a traceback.

Catch `torch.OutOfMemoryError` around the work, keep `oom_message(e)` for the row, and call `free(device)`
after the `except` block has ended (inside it the traceback still holds the frames, and with them the
tensors that filled the memory).
"""

from __future__ import annotations

import gc

import torch

OutOfMemory = torch.OutOfMemoryError


def oom_message(e: BaseException) -> str:
    """'out of memory: <the allocator's first line>', short enough for a table cell's note."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return "out of memory: " + first[:200]


def free(device: torch.device | str) -> None:
    """Return what the failed work held: collect its garbage and empty the CUDA caching allocator."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
