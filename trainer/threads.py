"""How many CPU threads a rank's torch ops use: one, unless told otherwise, so a CPU run is fast and steady
on a shared machine.

torch's default is one thread per physical core, per process. On a small machine that other jobs share,
that is the wrong choice twice: `--nproc-per-node N` starts N processes that each take every core, and a
thread pool's join waits for a core the scheduler gave to someone else. The README command took
144-343 s there, step times swinging from 0.06 s to 7 s, and 13 s with one thread (issue 18).

Measured on the 2-core shared machine of issue 18 (load 2.5-3 from other jobs), a step-like pair of GEMMs
(512 tokens x hidden H -> 3H -> H) took, with 2 threads against 1: 4.5x as long at H=64, 1.8x at 256,
1.6x at 512, 1.4x at 1024, 1.13x at 2048 (medians of 7 alternating rounds). No width gained, so the default
is one thread per rank: moectl's CPU runs are small models, demos and tests. A dedicated many-core machine
training something wider should say so: `train.cpu_threads`, or `OMP_NUM_THREADS`.

The choice, in order: `train.cpu_threads`; `OMP_NUM_THREADS` (the user's, or the launcher's, which passes
this same rule to its workers); else 1. GPU runs are left alone (their CPU side is kernel launches, and
torchrun already gives each rank one thread).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch


@dataclass(frozen=True)
class ThreadChoice:
    """Threads per rank, and why (for the run's banner)."""

    threads: int
    why: str


def choose_cpu_threads(requested: int | None, env: Mapping[str, str] = os.environ) -> ThreadChoice:
    """The threads one rank uses on a CPU run (see the module docstring)."""
    if requested is not None:
        return ThreadChoice(requested, "train.cpu_threads")
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return ThreadChoice(int(omp), "OMP_NUM_THREADS")
    return ThreadChoice(1, "default; train.cpu_threads sets more")


def apply_cpu_threads(choice: ThreadChoice) -> None:
    """Set torch's intra-op thread count (inter-op threads are left as they are: they start lazily)."""
    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
