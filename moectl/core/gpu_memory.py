"""How much memory a GPU has, from a number or a known name: what `validate-config --gpu-memory` checks against.

`validate-config` said "valid" for a config whose estimate was 92 GiB per rank on 80 GB GPUs (issue 18).
Rule MOE056 compares the per-rank estimate (moectl/core/summary.py) with the memory given here. Names
map to the memory CUDA reports for the board (nvidia-smi's `memory.total`, in MiB), which is what a run
can address, not the marketing figure: an "80 GB" H100 reports 81559 MiB = 79.6 GiB.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 2**30
MIB = 2**20

# nvidia-smi memory.total (MiB) of common training GPUs.
KNOWN_MIB = {
    "A100-40GB": 40960,
    "A100": 81920,  # the 80 GB board
    "H100": 81559,  # SXM and PCIe 80 GB
    "H100-NVL": 95830,
    "H200": 143771,
    "B200": 183359,
    "L40S": 46068,
    "L4": 23034,
}


@dataclass(frozen=True)
class GpuMemory:
    """Bytes of one GPU, and how the user named it (for messages)."""

    bytes: int
    label: str


def parse_gpu_memory(text: str) -> GpuMemory:
    """`80` or `79.6` (GiB), `80GiB`, or a known name (`H100`, `h200`, `A100-40GB`); ValueError otherwise."""
    t = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(?:GiB|G)?", t, flags=re.IGNORECASE)
    if m and float(m.group(1)) > 0:
        return GpuMemory(int(float(m.group(1)) * GIB), f"{float(m.group(1)):g} GiB")
    for name, mib in KNOWN_MIB.items():
        if t.upper().replace("_", "-") == name:
            return GpuMemory(mib * MIB, f"{name} ({mib * MIB / GIB:.1f} GiB)")
    known = ", ".join(KNOWN_MIB)
    raise ValueError(f"--gpu-memory {text!r}: expected GiB per GPU (e.g. 80) or one of {known}")
