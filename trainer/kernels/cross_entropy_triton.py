"""Triton kernels of `trainer.cross_entropy`: cross-entropy rows of `[N, V]` logits, forward and backward.

One program per row. The forward walks the row in BLOCK_V chunks keeping, per lane, a running max and the sum
of `exp(x - max)` (in fp32), folds the lanes into the row's log-sum-exp and writes it with the row's loss
`lse - x[target]` (0 for an ignored target, NaN for one outside the vocabulary); the caller sums the rows in
torch (a fixed order). The backward walks the row again and writes `(exp(x - lse) - [v == target]) * scale` in
the logits' dtype, `scale` being the device scalar `grad / count` (0 on ignored rows, NaN on a row whose target is
outside the vocabulary). The forward reads the
logits once, the backward once and writes the grad once.

Imported lazily on CUDA only; importing it needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048  # logits per chunk of a row
NUM_WARPS = 8
_FLOOR = -1.0e30  # a lane's running max before it has seen a logit (exp(-inf - floor) is 0, never NaN)


@triton.jit
def _ce_fwd_kernel(x_ptr, t_ptr, loss_ptr, lse_ptr, V, stride, IGNORE: tl.constexpr, FLOOR: tl.constexpr,
                   BLOCK_V: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_V,), FLOOR, tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
    tgt = tl.load(t_ptr + row)
    counted = tgt != IGNORE
    # a target outside [0, V) reads nothing and makes the loss NaN (the step's non-finite guard then names it),
    # where torch's kernel would stop the process with a device-side assert
    x_t = tl.load(base + tgt, mask=counted & (tgt >= 0) & (tgt < V), other=float("nan")).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(counted, lse - x_t, 0.0))


@triton.jit
def _ce_bwd_kernel(x_ptr, t_ptr, lse_ptr, scale_ptr, dx_ptr, V, stride, dx_stride, IGNORE: tl.constexpr,
                   BLOCK_V: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride
    out = dx_ptr + row.to(tl.int64) * dx_stride
    cols = tl.arange(0, BLOCK_V)
    tgt = tl.load(t_ptr + row)
    scale = tl.where(tgt != IGNORE, tl.load(scale_ptr), 0.0)
    scale = tl.where((tgt == IGNORE) | ((tgt >= 0) & (tgt < V)), scale, float("nan"))  # as its loss: NaN
    lse = tl.load(lse_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        ok = v0 + cols < V
        x = tl.load(base + v0 + cols, mask=ok, other=0.0).to(tl.float32)
        d = (tl.exp(x - lse) - tl.where(v0 + cols == tgt, 1.0, 0.0)) * scale
        tl.store(out + v0 + cols, d.to(dx_ptr.dtype.element_ty), mask=ok)


def cross_entropy_forward(logits_NV: torch.Tensor, targets_N: torch.Tensor,
                          ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(loss per row, log-sum-exp per row), fp32 `[N]` each; rows with an ignored target have loss 0."""
    N, V = logits_NV.shape
    x = logits_NV if logits_NV.stride(1) == 1 else logits_NV.contiguous()
    loss = torch.empty(N, dtype=torch.float32, device=x.device)
    lse = torch.empty(N, dtype=torch.float32, device=x.device)
    if N:
        _ce_fwd_kernel[(N,)](x, targets_N.contiguous(), loss, lse, V, x.stride(0), IGNORE=ignore_index,
                             FLOOR=_FLOOR, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)  # fmt: skip
    return loss, lse


def cross_entropy_backward(logits_NV: torch.Tensor, targets_N: torch.Tensor, lse_N: torch.Tensor,
                           scale: torch.Tensor, ignore_index: int) -> torch.Tensor:  # fmt: skip
    """The logits' grad in their dtype: `(softmax - one_hot) * scale` (`scale` an fp32 device scalar)."""
    N, V = logits_NV.shape
    x = logits_NV if logits_NV.stride(1) == 1 else logits_NV.contiguous()
    dx = torch.empty((N, V), dtype=x.dtype, device=x.device)
    if N:
        _ce_bwd_kernel[(N,)](x, targets_N.contiguous(), lse_N, scale.reshape(1), dx, V, x.stride(0), dx.stride(0),
                             IGNORE=ignore_index, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)  # fmt: skip
    return dx
