"""Expert weight grads accumulated into fp32 targets: the Triton kernel on CUDA, its definition elsewhere.

    targets[e] += a[rows of e]^T @ b[rows of e]   (fp32 products, never rounded to the operands' dtype)

`targets` are E fp32 `[M, N]` tensors (views of a grouped param's main_grad, or the per-expert params' own
main_grads); rows are grouped by expert, `tokens_per_expert_E[e]` each.
"""

from __future__ import annotations

from typing import Sequence

import torch

from trainer.kernels import has_triton


def grouped_wgrad_reference_(targets: Sequence[torch.Tensor], a_TM: torch.Tensor, b_TN: torch.Tensor,
                             tokens_per_expert_E: torch.Tensor) -> None:
    """The definition, expert by expert in fp32 (the CPU path and the tests' reference)."""
    start = 0
    for target, n in zip(targets, tokens_per_expert_E.tolist()):
        if n:
            target.addmm_(a_TM[start:start + n].t().float(), b_TN[start:start + n].float())
        start += n


def accumulate_grouped_wgrad_(targets: Sequence[torch.Tensor], a_TM: torch.Tensor, b_TN: torch.Tensor,
                              tokens_per_expert_E: torch.Tensor, offs_E: torch.Tensor | None = None) -> None:
    """targets[e] += a[rows of e]^T b[rows of e]; one Triton launch on CUDA (no host sync), else the reference.

    `offs_E`: the cumulative row ends, if the caller has them on the device already.
    """
    if not (a_TM.is_cuda and has_triton()):
        grouped_wgrad_reference_(targets, a_TM, b_TN, tokens_per_expert_E)
        return
    from trainer.kernels.grouped_wgrad_triton import grouped_wgrad_accumulate_  # lazy: needs Triton

    base = targets[0]
    M, N = base.shape
    for t in targets:
        if t.dtype != torch.float32 or tuple(t.shape) != (M, N) or t.stride() != (N, 1):
            raise ValueError("grouped wgrad targets must be contiguous fp32 [M, N] matrices of one shape")
    if offs_E is None:
        offs_E = torch.cumsum(tokens_per_expert_E.to(a_TM.device), 0)
    grouped_wgrad_accumulate_(base, _offsets_from(base, targets), a_TM.contiguous(), b_TN.contiguous(), offs_E, M, N)


_OFFSETS: dict[tuple[int, ...], torch.Tensor] = {}


def _offsets_from(base: torch.Tensor, targets: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each target's element offset from `base` on the device, made once per set of addresses (main_grad
    views keep their addresses for the whole run, so the copy to the device is not repeated every call)."""
    key = tuple(t.data_ptr() for t in targets)
    if key not in _OFFSETS:
        offs = torch.tensor([(ptr - key[0]) // 4 for ptr in key], dtype=torch.int64)
        _OFFSETS[key] = offs.to(base.device)
    return _OFFSETS[key]
