"""Triton kernel: zero the chunks of a grad buffer whose stale flag is still set, one launch, nearly free when
none is.

A stale-capable grad (`trainer/main_grad.py`) must be written by its layer in every step before the buffer
is reduced or read. A layer whose backward did not run leaves its flag set and last step's values in place;
`trainer/kernels/stale_zero.py` calls this before any reduce so such a grad reads as zero, as a zero fill
would have made it. Each program owns one chunk of one param (`chunks_C3`: start, length, flag index; lengths
at most CHUNK) and reads one flag: where it is clear (every normal step) the program stores nothing, so a
launch over the 1.6B expert grads of the reference model is a few microseconds, not a pass over 6.4 GB.

Imported lazily on CUDA only; importing it needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1 << 16  # elements per program


@triton.jit
def _zero_stale_kernel(grad_ptr, chunks_ptr, flags_ptr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * 3
    if tl.load(flags_ptr + tl.load(chunks_ptr + i + 2)) == 0:
        return
    start = tl.load(chunks_ptr + i)
    n = tl.load(chunks_ptr + i + 1)
    for off in tl.range(0, CHUNK, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        tl.store(grad_ptr + start + idx, tl.zeros((BLOCK,), dtype=tl.float32), mask=idx < n)


def zero_stale_chunks_(grad: torch.Tensor, chunks_C3: torch.Tensor, flags: torch.Tensor) -> None:
    """Zero `grad[start:start + n]` for every chunk `(start, n, f)` of `chunks_C3` (int64, on the device) whose
    `flags[f]` is nonzero; `grad` fp32, contiguous. Flags are only read."""
    if grad.dtype != torch.float32 or not grad.is_contiguous():
        raise ValueError("zero_stale_chunks_ takes a contiguous fp32 grad buffer")
    if chunks_C3.shape[0]:
        _zero_stale_kernel[(chunks_C3.shape[0],)](grad, chunks_C3, flags, BLOCK=4096, CHUNK=CHUNK, num_warps=4)
