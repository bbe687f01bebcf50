"""Transformer Engine for the `te` expert backend: imported on first use, checked against the pinned version.

TE is optional and heavy to import (seconds, and it touches CUDA), so nothing imports it at package import:
`load_te()` does, once, when the first `te` backend is built. torch is imported before TE on purpose:
`libtransformer_engine.so` needs NCCL, which torch's wheel preloads and TE does not (docs/te_setup.md:
importing TE first failed with `libnccl.so.2: cannot open shared object file`). And TE loads cuDNN from the
system before Python packages, where torch loaded its own (pip) cuDNN: on the device machines, whose system
cuDNN is another build, a process that had not yet used cuDNN failed the import with `libcudnn_cnn.so.9:
undefined symbol ... version libcudnn_graph.so.9` (one cuDNN's pieces bound to the other's). So, unless the
user chose one (`CUDNN_HOME`/`CUDNN_PATH`), every library of torch's cuDNN package is loaded globally first, as
TE itself does where no CUDA toolkit is installed, so the names resolve to torch's cuDNN whatever TE finds.

Pinned: TE 2.20 (written against 2.20.2's source). The backend calls what TE's own `GroupedLinear` calls
(`cpp_extensions.general_grouped_gemm`, `tex.split_quantize`, the row-scaled GLU kernels,
`Float8CurrentScalingQuantizer`); those are TE internals, not a stable API. An older TE is refused, a newer
one warned about: here at first use, and before the run by rule MOE022 (package metadata, no import).
`transformer_engine.pytorch` has no `__version__`; the version is `transformer_engine.__version__`.
"""

from __future__ import annotations

import ctypes
import glob
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch  # noqa: F401  (before TE: see the module docstring)

from moectl.core.errors import MoectlError
from moectl.core.rules import TE_MIN_VERSION, TE_PINNED_VERSION, parse_version


@dataclass(frozen=True)
class TE:
    """The TE entry points the backend uses (a test may hand the backend a stand-in with the same names)."""

    version: str
    tex: Any  # transformer_engine_torch: kernels (scaled_swiglu, ...), split_quantize, DType
    general_grouped_gemm: Any  # transformer_engine.pytorch.cpp_extensions.general_grouped_gemm
    Float8CurrentScalingQuantizer: Any  # transformer_engine.pytorch.tensor.float8_tensor


_LOADED: Optional[TE] = None
_FIX = "install TE 2.20.2 (docs/te_setup.md, scripts/gpu_te_setup.sh), or set moe.backend: fused"


def load_te() -> TE:
    """Import TE once and return its entry points; MoectlError (with the fix) where it is missing or too old."""
    global _LOADED
    if _LOADED is None:
        _LOADED = _import_te()
    return _LOADED


def _use_torchs_cudnn() -> None:
    """Load torch's pip cuDNN libraries globally before TE looks for cuDNN (see the module docstring)."""
    if os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH"):
        return
    try:
        import nvidia.cudnn as cudnn_pkg  # the nvidia-cudnn-cu* wheel torch depends on
    except ImportError:
        return
    roots = getattr(cudnn_pkg, "__path__", [])
    libs = [p for root in roots for p in glob.glob(os.path.join(root, "lib", "libcudnn*.so*"))]
    pending = sorted(libs, key=lambda p: (os.path.basename(p).startswith("libcudnn.so"), p))  # the shim last
    while pending:  # a library whose dependencies are not loaded yet fails; retry it after the others
        failed = []
        for path in pending:
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                failed.append(path)
        if len(failed) == len(pending):
            return  # nothing more loads: leave the rest to TE's own search
        pending = failed


def _import_te() -> TE:
    _use_torchs_cudnn()
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401  (loads the extension; registers its quantizers)
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.cpp_extensions import general_grouped_gemm
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer
    except (ImportError, OSError) as e:  # OSError: a shared library TE needs (libnccl, libcudnn) not found
        raise MoectlError(f"moe.backend=te could not import Transformer Engine: {type(e).__name__}: {e}", _FIX) from e
    version = str(getattr(transformer_engine, "__version__", "unknown"))
    check_version(version)
    return TE(version, tex, general_grouped_gemm, Float8CurrentScalingQuantizer)


def check_version(version: str) -> None:
    """Refuse a TE older than TE_MIN_VERSION; warn about one newer than the pinned major.minor."""
    found = parse_version(version)
    want = ".".join(map(str, TE_MIN_VERSION))
    if found is None or found < TE_MIN_VERSION:
        raise MoectlError(f"moe.backend=te needs Transformer Engine >= {want}; found {version}", _FIX)
    if found[:2] > TE_MIN_VERSION:
        warnings.warn(
            f"moe.backend=te was written against Transformer Engine {TE_PINNED_VERSION}; found {version}, whose "
            "internal grouped-GEMM and activation functions may differ (tests/trainer/moe/backends/"
            "test_te_backend_gpu.py checks them)",
            stacklevel=3,
        )


def describe(recipe_name: Optional[str], activation: str) -> str:
    """One line for the run's banner: which expert GEMMs Transformer Engine runs, and in what precision
    (no TE import: the version comes from package metadata until the backend has loaded TE)."""
    from moectl.core.rules import probe_te

    found = probe_te()
    version = _LOADED.version if _LOADED is not None else (found.version if found else "not installed")
    kernel = {"swiglu": "tex.scaled_swiglu", "quick_geglu": "tex.scaled_clamped_swiglu"}.get(activation, "tex.scaled_srelu")
    gemms = (
        "in fp8 (Float8CurrentScaling per expert: fprop, dgrad and wgrad in TE's fp8 GEMMs)"
        if recipe_name == "tensorwise"
        else "in the model dtype"
    )
    return (
        f"experts: moe.backend=te, Transformer Engine {version}: fc1/fc2 grouped GEMMs through "
        f"general_grouped_gemm {gemms}, probs * {activation} through {kernel}"
    )
