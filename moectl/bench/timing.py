"""Timing helpers shared by the benchmarks: median of many timed calls, and the dense matmul ceiling.

On CUDA each call is bracketed by CUDA events (device time, launch overhead included as it is in training),
after warm-up calls that keep compilation, autotuning and handle creation out of the numbers; the median
of the timed calls is reported (robust to the odd slow call). On CPU a host clock does the same.

Competing versions are timed in interleaved rounds (`interleaved_ms`): a few calls of each version in turn,
repeated, so that a drift of the device's state (clocks, temperature) over the run is shared by all of them
instead of favouring whichever ran first; each round starts with one untimed call per version, so that no
version pays for the allocator state the previous one left. Back-to-back runs of the same version on an H200
moved by up to ~5%, and its dense matmul rate fell from ~805 to ~730 TFLOP/s over a 2-minute run;
interleaving is what makes side-by-side ratios trustworthy.

`queued_ms` measures the other regime: device time per call when the host has queued the calls ahead (one
event pair over several calls behind a sleep kernel), what a training step sees when its CPU runs ahead. A
path heavy in host work (many small launches) looks slower per call from an idle queue than queued; on an
H200 the fp8 expert MLP's two numbers differed by 5-10% (docs/benchmarks.md).
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
    return statistics.median(_timed(fn, device, iters))


def interleaved_ms(
    fns: dict[str, Callable[[], object]], device: torch.device, warmup: int, rounds: int, per_round: int
) -> dict[str, list[float]]:
    """All timed calls (ms) of each version, measured in `rounds` interleaved rounds of `per_round` calls."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()  # untimed: back to this version's steady state (caching allocator, caches) after the others
            samples[name].extend(_timed(fn, device, per_round))
    return samples


# Cycles of the device-side sleep that holds the GPU while the host queues a round of `queued_ms` (~20 ms at
# the ~2 GHz of an H100/H200: room for a few calls of several ms of host work each).
HEAD_START_CYCLES = 40_000_000


def queued_ms(
    fns: dict[str, Callable[[], object]], device: torch.device, rounds: int, calls: int
) -> tuple[dict[str, list[float]], set[str]]:
    """Device time per call (ms) with the host ahead of the device, as in a training step whose CPU runs
    ahead of its GPU: per version and round, a sleep kernel holds the device while the host queues `calls`
    calls, and one pair of events brackets them (time / calls). Launch latency and host gaps are out of the
    number; what `interleaved_ms` measures per call from an idle queue keeps them in. Versions interleave
    by round, as there. CUDA only (an empty result elsewhere).

    Also returns the versions whose host work outlasted the head start in some round (the device caught up
    with the host, so that round included host time): their numbers are upper bounds."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    behind: set[str] = set()
    if device.type != "cuda":
        return {}, behind
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()  # untimed, as in interleaved_ms
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HEAD_START_CYCLES)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            if start.query():  # the sleep ended before the host had queued every call
                behind.add(name)
            torch.cuda.synchronize(device)
            samples[name].append(start.elapsed_time(end) / calls)
    return samples, behind


def _timed(fn: Callable[[], object], device: torch.device, iters: int) -> list[float]:
    """Times (ms) of `iters` consecutive calls."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for start, end in zip(starts, ends):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def dense_matmul(device: torch.device, dtype: torch.dtype, size: int, seed: int = 0) -> Callable[[], object]:
    """One dense size^3 matmul on random data (zeros run faster than real data on some GPUs), as a call."""
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    return lambda: torch.mm(a, b)


def dense_ceiling_tflops(
    device: torch.device, dtype: torch.dtype, size: int, warmup: int, iters: int, seed: int = 0
) -> float:
    """TFLOP/s of one dense size^3 matmul on random data."""
    ms = median_ms(dense_matmul(device, dtype, size, seed), device, warmup, iters)
    return 2 * size**3 / (ms * 1e-3) / 1e12
