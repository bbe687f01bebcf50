"""The Transformer Engine columns of `moectl bench grouped-mlp`: whether they can run here, and why not.

    te                  moectl's `te` expert backend in bf16 (trainer/moe/backends/te.py): TE's grouped GEMMs
                        (`general_grouped_gemm`, what `te.GroupedLinear` runs) around TE's row-scaled SwiGLU
    te_fp8_tensorwise   the same under moectl's fp8 tensorwise recipe, run as TE's Float8CurrentScaling
                        (weights quantized in every call, as `fp8_tensorwise`)

They run only on CUDA with TE installed (scripts/gpu_te_setup.sh); elsewhere the table's notes say why.
"""

from __future__ import annotations

import functools

import torch

TE_PATHS = ("te", "te_fp8_tensorwise")


@functools.lru_cache(maxsize=None)
def _te_import_error() -> str:
    """'' when TE imports (and passes the backend's version check), else why not (imports TE: call lazily)."""
    from moectl.core.errors import MoectlError

    try:
        from trainer.moe.backends.te_runtime import load_te

        load_te()
    except MoectlError as e:
        return str(e)
    return ""


def available(path: str, device: torch.device) -> tuple[bool, str]:
    """Whether the TE column `path` can run on `device`, and if not, why (said in the table's notes)."""
    if device.type != "cuda":
        return False, f"{path}: not run on {device.type} (Transformer Engine's kernels are CUDA only)"
    why = _te_import_error()
    if why:
        return False, f"{path}: not run: {why} (scripts/gpu_te_setup.sh installs TE 2.20.2)"
    return True, ""
