"""Where a training step's device time goes, from a torch profiler trace of a few steps.

`activities(events)` turns the profiler's events into `Activity` records: every CUDA kernel, memcpy and
memset (on a CPU run: every outermost aten op, e.g. `aten::linear`), with the CPU ops around its launch and the trainer region it
belongs to. Forward work sits inside a region's range (`trainer/regions.py`). Backward work runs in
autograd's `evaluate_function: <Node>` ranges, outside any region; the profiler records on that range the
sequence number of the node and the forward thread, and on the forward op that made the node the same
number, so a backward kernel takes the region of its forward op. Autograd's `AccumulateGrad` nodes (a
param's grad landing, and the post-accumulate hooks that fold it into `main_grad`) get `grad.accumulate`.

`split(acts, steps)` sums kernel time per category (`kernel_classes.py`) and measures, per step:
- busy: the union of all activity intervals (what some stream was doing);
- concurrent: category time minus busy, i.e. time counted twice because streams overlapped;
- communication, exposed vs overlapped: the part of each communication kernel during which some other
  (non-communication) activity ran on another stream is overlapped; the rest is exposed.
Idle is the caller's: step time minus busy (the bench uses the unprofiled step time, since the profiler's
own host overhead stretches the profiled steps).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from moectl.bench.kernel_classes import CATEGORIES, classify
from trainer.regions import GRAD_ACCUMULATE

EVALUATE = "autograd::engine::evaluate_function: "


@dataclass(frozen=True)
class Activity:
    """One piece of device work."""

    name: str
    start_us: float
    end_us: float
    stream: int
    ops: tuple[str, ...] = ()  # the launching CPU op, then its callers
    region: Optional[str] = None

    @property
    def us(self) -> float:
        return self.end_us - self.start_us

    @property
    def category(self) -> str:
        return classify(self.name, self.ops, self.region)


def _ancestors(e: Any) -> Iterable[Any]:
    while e is not None:
        yield e
        e = e.cpu_parent


def _forward_regions(cpu: list[Any], regions: set[str]) -> dict[tuple[int, int], str]:
    """(thread, sequence number) -> region of the last forward op that recorded it (the node's maker)."""
    out: dict[tuple[int, int], str] = {}
    for e in sorted(cpu, key=lambda e: e.time_range.start):
        if e.sequence_nr < 0 or e.is_user_annotation:
            continue
        chain = list(_ancestors(e))
        if any(a.name.startswith(EVALUATE) for a in chain):
            continue  # backward work records sequence numbers too
        region = next((a.name for a in chain if a.is_user_annotation and a.name in regions), None)
        if region is not None:
            out[(e.thread, e.sequence_nr)] = region
        else:
            out.pop((e.thread, e.sequence_nr), None)
    return out


def _context(op: Any, regions: set[str], fwd: dict[tuple[int, int], str]) -> tuple[tuple[str, ...], Optional[str]]:
    """(op names innermost first, region) of a launching CPU op."""
    chain = list(_ancestors(op))
    names = tuple(a.name for a in chain if not a.is_user_annotation)
    for a in chain:
        if a.is_user_annotation and a.name in regions:
            return names, a.name
        if a.name.startswith(EVALUATE):
            if a.name.endswith("AccumulateGrad"):  # a leaf's grad landing (and the hooks that fold it)
                return names, GRAD_ACCUMULATE
            return names, fwd.get((a.fwd_thread, a.sequence_nr))
    return names, None


def activities(events: Iterable[Any], regions: Iterable[str], device: str = "cuda") -> list[Activity]:
    """Device work of a profile (`profile.events()`); on a CPU profile (`device='cpu'`) the outermost aten ops."""
    from torch.autograd import DeviceType

    regions = set(regions)
    events = list(events)
    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    fwd = _forward_regions(cpu, regions)
    out = []
    if device == "cpu":  # the outermost aten ops: on one thread they never overlap
        for e in cpu:
            parent = e.cpu_parent
            if not e.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
                continue
            names, region = _context(e, regions, fwd)
            out.append(Activity(e.name, e.time_range.start, e.time_range.end, e.thread, names, region))
        return out
    launches = _launches(cpu)
    annotations = {e.name for e in cpu if e.is_user_annotation}
    # GPU-side copies of host ranges are not work: user ranges, and c10d's `nccl:all_to_all` etc. (not always
    # flagged), which counted every collective twice. Not every host name: inductor names a CPU range after
    # each Triton kernel it launches.
    for e in events:
        if (e.device_type != DeviceType.CUDA or e.is_user_annotation or e.name in annotations
                or e.name.startswith(("ProfilerStep", "nccl:"))):
            continue
        launch = launches.get(getattr(e, "linked_correlation_id", None) or e.id)
        op = launch.cpu_parent if launch is not None else None  # the aten op that made the runtime call
        names, region = _context(op, regions, fwd) if op is not None else ((), None)
        stream = int(getattr(e, "device_resource_id", 0) or 0)
        out.append(Activity(e.name, e.time_range.start, e.time_range.end, stream, names, region))
    return out


def _launches(cpu: list[Any]) -> dict[int, Any]:
    """CUDA runtime calls (cudaLaunchKernel, cuLaunchKernel, cudaMemcpyAsync, ...) by correlation id. A
    device event carries the correlation id of the runtime call that queued it: as its own `id` (torch 2.11,
    seen on an H100: kernel and launch share the id) or as `linked_correlation_id` (older torch). Only runtime
    calls are keyed: aten ops number their ids separately and would collide."""
    return {e.id: e for e in cpu if e.name.startswith(("cuda", "cu")) and not e.is_user_annotation}


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, merged, disjoint intervals covering the same points."""
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            if e > merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def covered(s: float, e: float, merged: list[tuple[float, float]], starts: list[float]) -> float:
    """How much of [s, e) the disjoint sorted `merged` intervals cover (`starts`: their starts)."""
    i = max(bisect.bisect_right(starts, s) - 1, 0)
    total = 0.0
    while i < len(merged) and merged[i][0] < e:
        lo, hi = max(s, merged[i][0]), min(e, merged[i][1])
        total += max(0.0, hi - lo)
        i += 1
    return total


@dataclass
class Split:
    """Per-step device time by category (ms), with what ran concurrently and what communication hid."""

    steps: int
    category_ms: dict[str, float]
    busy_ms: float
    concurrent_ms: float
    comm_exposed_ms: float
    comm_overlapped_ms: float
    kernels_per_step: float
    top: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # category -> heaviest kernels
    unattributed_ms: float = 0.0  # device time with no region (outside the model, e.g. the data copy)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def split(acts: list[Activity], steps: int, top: int = 5) -> Split:
    """Category totals per step (see the module docstring); `steps` is how many steps `acts` span."""
    steps = max(steps, 1)
    cat_us: dict[str, float] = defaultdict(float)
    per_kernel: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    cats = []
    unattributed = 0.0
    for a in acts:
        c = a.category
        cats.append(c)
        cat_us[c] += a.us
        k = per_kernel[(c, a.name)]
        k[0] += a.us
        k[1] += 1
        if a.region is None:
            unattributed += a.us
    busy = union((a.start_us, a.end_us) for a in acts)
    busy_us = sum(e - s for s, e in busy)
    compute = union((a.start_us, a.end_us) for a, c in zip(acts, cats) if c != "comm")
    starts = [s for s, _ in compute]
    overlapped = sum(covered(a.start_us, a.end_us, compute, starts) for a, c in zip(acts, cats) if c == "comm")
    comm = cat_us.get("comm", 0.0)
    tops: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for (c, name), (us, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0]):
        if len(tops[c]) < top:
            tops[c].append({"name": name[:160], "ms": us / 1e3 / steps, "calls": n / steps})
    ms = 1e-3 / steps
    return Split(
        steps=steps,
        category_ms={k: cat_us.get(k, 0.0) * ms for k in CATEGORIES},
        busy_ms=busy_us * ms,
        concurrent_ms=(sum(cat_us.values()) - busy_us) * ms,
        comm_exposed_ms=(comm - overlapped) * ms,
        comm_overlapped_ms=overlapped * ms,
        kernels_per_step=len(acts) / steps,
        top=dict(tops),
        unattributed_ms=unattributed * ms,
    )
