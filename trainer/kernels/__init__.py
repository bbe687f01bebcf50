"""Kernels of the expert MLP: Triton on CUDA, each with a pure-torch reference used on CPU and in tests.

Nothing here imports Triton at import time: `glu_triton` and `fp8_quant_triton` are imported lazily on
CUDA only; `has_triton()` says whether they can be.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.lru_cache(maxsize=None)
def has_triton() -> bool:
    """Whether Triton can be imported (looked up once, without importing it; CI and CPU installs have none)."""
    return importlib.util.find_spec("triton") is not None
