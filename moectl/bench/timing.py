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

`sustained_ms` measures a third: device time per call under continuous load, once the device has settled at
the clock its power limit allows for that load. Both regimes above start from a rested device (a sync, or a
sleep kernel), and an H100/H200 boosts after a rest: at their 700 W cap both ran the bf16 expert MLP at
1470-1485 MHz under load and the fp8 one at 1620-1665 MHz, against up to 1980 MHz rested
(docs/benchmarks.md). Training keeps the GPU busy for hours, so this is the regime its throughput follows.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

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


# Seconds of calls per version and round in `sustained_ms`: the first half brings the device to the clock its
# power limit holds under the load (an H200 running the fp8 expert MLP sat at its 700 W cap, clock settled,
# within half a second), the second half is timed.
SUSTAINED_SECONDS = 2.0
# How many calls the host may queue ahead of the device in `sustained_ms`. Unbounded, the host of the bf16 fused
# expert MLP ran hundreds of calls ahead and the caching allocator, unable to reuse blocks still owned by
# queued side-stream work, ran out and flushed (alloc retries: 7-8% slower per call on an H100); a training step
# never runs that far ahead.
SUSTAINED_AHEAD = 2


@dataclass(frozen=True)
class DeviceState:
    """What the device did during one timed burst of `sustained_ms`."""

    mhz: Optional[float]  # SM clock, median of readings while the burst ran (None: no NVML / nvidia-smi)
    watts: Optional[float]  # board power, the same way
    alloc_retries: int  # caching-allocator retries (cache flushed and memory freed) during the burst


def sustained_ms(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    rounds: int,
    seconds: float = SUSTAINED_SECONDS,
    ahead: int = SUSTAINED_AHEAD,
) -> tuple[dict[str, list[float]], dict[str, list[DeviceState]]]:
    """Device time per call (ms) in steady state: per version and round, `seconds` of calls back to back, the
    host at most `ahead` calls ahead of the device (it waits for the call `ahead` back to finish, so the
    device never drains its queue while the host is faster than it), the first half untimed, one pair of
    events around the second half (time / calls). Versions interleave by round, as in `interleaved_ms`. Also
    what the device did meanwhile (`DeviceState`, one per round). CUDA only (empty results elsewhere);
    `seconds` <= 0 measures nothing."""
    if device.type != "cuda" or seconds <= 0:
        return {}, {}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    states: dict[str, list[DeviceState]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()  # untimed, as in interleaved_ms; its wall time sizes the halves
            torch.cuda.synchronize(device)
            calls = max(2, int(seconds / 2 / max(time.perf_counter() - t0, 1e-6)))
            done: list[Optional[torch.cuda.Event]] = [None] * max(1, ahead)

            def paced(i: int) -> None:
                slot = i % len(done)
                if done[slot] is not None:
                    done[slot].synchronize()  # type: ignore[union-attr]
                fn()
                done[slot] = torch.cuda.Event()
                done[slot].record()  # type: ignore[union-attr]

            for i in range(calls):
                paced(i)
            retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
            readings: list[tuple[Optional[float], Optional[float]]] = []
            stop = threading.Event()
            # read on a thread: a reading can take ~0.1 s (nvidia-smi), which would stall the host's queue
            reader = threading.Thread(target=_read_until, args=(device, stop, readings), daemon=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            reader.start()
            for i in range(calls, 2 * calls):
                paced(i)
            end.record()
            stop.set()
            reader.join()
            torch.cuda.synchronize(device)
            samples[name].append(start.elapsed_time(end) / calls)
            retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries
            mhz = [r[0] for r in readings if r[0] is not None]
            watts = [r[1] for r in readings if r[1] is not None]
            states[name].append(DeviceState(
                statistics.median(mhz) if mhz else None, statistics.median(watts) if watts else None, retries
            ))  # fmt: skip
    return samples, states


def _read_until(device: torch.device, stop: threading.Event, out: list[tuple[Optional[float], Optional[float]]]) -> None:
    while True:  # at least one reading, even of a burst shorter than a reading
        out.append(clock_and_power(device))
        if stop.wait(0.05):
            return


def clock_and_power(device: torch.device) -> tuple[Optional[float], Optional[float]]:
    """(SM clock in MHz, board power in W) of a CUDA device right now: NVML through torch, else `nvidia-smi`,
    else (None, None)."""
    try:
        return float(torch.cuda.clock_rate(device)), torch.cuda.power_draw(device) / 1000.0  # NVML reports mW
    except Exception:  # noqa: BLE001 - no pynvml here: try the command-line tool
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        out = subprocess.run(
            [smi, f"--id={index}", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
        mhz, watts = (float(v) for v in out.strip().splitlines()[0].split(","))
        return mhz, watts
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None, None


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
