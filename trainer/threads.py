"""How many CPU threads a rank's torch ops use, chosen so a small model runs fast and steadily on a shared CPU.

torch's default is one thread per physical core, per process. That is wrong twice for a CPU run of a
small model: `--nproc-per-node N` starts N processes that each take every core, and the GEMMs of a
narrow model (hidden size 64: ~0.1 ms each) are shorter than the cost of waking and joining a second
thread. On a machine other jobs share, that join waits for a core the scheduler gave to someone else:
the README command took 144-343 s there with step times from 0.06 s to 7 s, and 13 s with one thread
(issue 18; the measurement behind `WIDE_HIDDEN` is in docs/design.md).

The choice, in order: `train.cpu_threads` when set; `OMP_NUM_THREADS` when set (by the user, or by the
launcher, which applies this same rule for its workers); else one thread for a model narrower than
`WIDE_HIDDEN`, and otherwise the cores this process may run on divided by the ranks on this machine.
GPU runs are left alone (their CPU side is launch work, and torchrun already sets one thread per rank).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch

# From this hidden size up, a rank's GEMMs are long enough to gain from more threads (docs/design.md).
WIDE_HIDDEN = 1024


@dataclass(frozen=True)
class ThreadChoice:
    """Threads per rank, and why (for the run's banner)."""

    threads: int
    why: str


def usable_cores() -> int:
    """The cores this process may be scheduled on (its affinity mask; a container's cpuset shows here)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def choose_cpu_threads(
    requested: int | None, hidden_size: int, local_world_size: int, env: Mapping[str, str] = os.environ
) -> ThreadChoice:
    """The threads one rank should use for a model of `hidden_size` with `local_world_size` ranks per machine."""
    if requested is not None:
        return ThreadChoice(requested, "train.cpu_threads")
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return ThreadChoice(int(omp), "OMP_NUM_THREADS")
    if hidden_size < WIDE_HIDDEN:
        return ThreadChoice(1, f"auto: hidden_size {hidden_size} < {WIDE_HIDDEN}, one thread is fastest")
    per_rank = max(1, usable_cores() // max(1, local_world_size))
    return ThreadChoice(per_rank, f"auto: {usable_cores()} cores / {local_world_size} rank(s) on this machine")


def apply_cpu_threads(choice: ThreadChoice) -> None:
    """Set torch's intra-op thread count (inter-op threads are left as they are: they start lazily)."""
    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
