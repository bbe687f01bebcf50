"""Kernels: Triton on CUDA, each with a pure-torch reference used on CPU and in tests.

The bottom of the engine's numeric stack: kernels import torch (and Triton, lazily), never the layers that
call them (`precision`, `moe`). Nothing here imports Triton at import time: the `*_triton` modules are
imported lazily on CUDA only; `has_triton()` says whether they can be, `capability()` what the GPU is.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal, Optional

import torch

from trainer.switches import switched_off


@functools.lru_cache(maxsize=None)
def has_triton() -> bool:
    """Whether Triton can be imported (looked up once, without importing it; CI and CPU installs have none)."""
    return importlib.util.find_spec("triton") is not None


def triton_runs(device: torch.device, switch: str) -> bool:
    """Whether work on `device` takes a Triton kernel: CUDA, Triton importable, and the kernel's A/B switch
    (`switch`, e.g. `MOECTL_TRITON_SORT`; `trainer/switches.py`) not turned off."""
    return device.type == "cuda" and has_triton() and not switched_off(switch)


def capability(device: torch.device | str | None) -> Optional[tuple[int, int]]:
    """CUDA compute capability of `device`, or None for a non-CUDA device / no CUDA."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def fp32_out_gemm(device: torch.device, op: Literal["mm", "addmm"]) -> bool:
    """Whether torch runs `op` on `device` with bf16 operands and an fp32 output (`out_dtype`, torch 2.8+ on
    CUDA; asked once per device and op): `mm` writes the product, `addmm` adds it into an fp32 `out`."""
    if device.type != "cuda":
        return False
    a = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
    try:
        if op == "mm":
            return bool((torch.mm(a, a, out_dtype=torch.float32) == 2).all())
        c = torch.ones(2, 2, device=device)
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
        return bool((c == 3).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    # cached: asked before every grouped GEMM, and the device query cost ~40 us of host time per call on an
    # H200 host, about 0.2 ms of a 4.5 ms fp8 expert-MLP step
    return torch.cuda.get_device_capability(index)
