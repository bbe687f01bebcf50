"""One host buffer that a rank's staged tensors live in: sized exactly, page-locked once, reused.

Why not `torch.empty(..., pin_memory=True)` per tensor: torch's pinned allocator rounds every request up to
a power of two, so at the reference size each 537 MB fc1 master (and each of its moments) pinned 1 GiB, and
a rank's 12.8 GB share pinned about 23 GiB; pinning is the cost the first background save blocked on
(5.3 s on 2 H100s, docs/benchmarks.md). Here one anonymous mapping of the exact total is made, its pages
are touched on several threads (the page faults and zeroing are most of the cost, and they parallelise),
then it is registered with CUDA in one call (`cudaHostRegister`), which locks those pages: device-to-host
copies into it then run at the bus's speed and asynchronously, as into any pinned memory.

Where registering is not possible (no `torch.cuda.cudart`, or the driver refuses), the buffer falls back to
one `pin_memory=True` tensor of the total (torch's own allocator; rounded, but one rounding instead of one
per tensor). Without a device (`pin=False`) it is plain memory, touched as it is copied into.
"""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor

import torch

from moectl.core.arith import round_up

ALIGN = 64  # bytes between views: whole cache lines, and a multiple of every dtype's element size
_TOUCH_GRAIN = 64 << 20  # bytes per page-touching task
REGISTERED, TORCH_PINNED, PAGEABLE = "registered", "torch-pinned", "pageable"


def aligned(n: int) -> int:
    """`n` rounded up to `ALIGN`."""
    return round_up(n, ALIGN)


class HostArena:
    """`nbytes` of host memory, page-locked when `pin` (for copies from a CUDA device). `how` says what it is:
    `REGISTERED`, `TORCH_PINNED` (the fallback) or `PAGEABLE`."""

    def __init__(self, nbytes: int, pin: bool, threads: int = 1) -> None:
        self.nbytes = nbytes
        self.pin = pin
        self._mapping: mmap.mmap | None = None
        self._registered_ptr: int | None = None
        if not pin or nbytes == 0:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
            self.how = PAGEABLE
            return
        try:
            self._map_and_register(nbytes, threads)
            self.how = REGISTERED
        except (AttributeError, AssertionError, RuntimeError, OSError, ValueError):  # torch without CUDA asserts
            self.release()
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.how = TORCH_PINNED

    def _map_and_register(self, nbytes: int, threads: int) -> None:
        cudart = torch.cuda.cudart()  # AttributeError/RuntimeError where torch has no CUDA runtime
        self._mapping = mmap.mmap(-1, nbytes)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer, larger page faults where the kernel allows huge pages
            try:
                self._mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.buffer = torch.frombuffer(self._mapping, dtype=torch.uint8)
        touch(self.buffer, threads)
        ptr = self.buffer.data_ptr()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)  # releases the GIL; the pages are already there
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed ({err})")
        self._registered_ptr = ptr

    def view(self, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` over the arena's bytes from `offset` (a multiple of `ALIGN`)."""
        n = shape.numel() * dtype.itemsize
        return self.buffer[offset : offset + n].view(dtype).reshape(shape)

    def release(self) -> None:
        """Unlock and free the memory (no copy into it may be in flight; views must no longer be used)."""
        if self._registered_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            self._registered_ptr = None
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._mapping = None  # unmapped once the last tensor over it is gone


def touch(buffer: torch.Tensor, threads: int) -> None:
    """Fault in every page of `buffer` on `threads` threads (torch releases the GIL while it fills)."""
    n = buffer.numel()
    starts = range(0, n, _TOUCH_GRAIN)
    if threads <= 1 or len(starts) <= 1:
        buffer.zero_()
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moectl-ckpt-touch") as pool:
        list(pool.map(lambda s: buffer[s : s + _TOUCH_GRAIN].zero_(), starts))
