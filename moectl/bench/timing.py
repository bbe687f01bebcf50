"""Timing helpers shared by the benchmarks: median of many timed calls, and the dense matmul ceiling.

On CUDA each call is bracketed by CUDA events (device time, launch overhead included as it is in training),
after warm-up calls that keep compilation, autotuning and handle creation out of the numbers; the median
of the timed calls is reported (robust to the odd slow call). On CPU a host clock does the same.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time of `fn()` in milliseconds over `iters` calls, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for start, end in zip(starts, ends):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def dense_ceiling_tflops(
    device: torch.device, dtype: torch.dtype, size: int, warmup: int, iters: int, seed: int = 0
) -> float:
    """TFLOP/s of one dense size^3 matmul on random data (zeros run faster than real data on some GPUs)."""
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    ms = median_ms(lambda: torch.mm(a, b), device, warmup, iters)
    return 2 * size**3 / (ms * 1e-3) / 1e12
