"""Triton kernel: AdamW over one flat shard in one pass, writing the bf16 params too (CUDA).

`DistributedOptimizer` keeps each bucket shard's fp32 masters, grads and moments as flat tensors. torch's
fused AdamW (`torch._fused_adamw_`) takes them as lists of per-param runs (decayed and not: two calls, and a
second pair with a `grad_scale` when clipping may be needed), reaching ~2.3 TB/s on an H100, and staging then
reads every master again to write the bf16 params: 28 + 6 bytes per element. Here one launch per shard reads
grad, master and both moments and writes master, moments and the bf16 param: 30 bytes per element.

- weight decay per element from a per-chunk flag (`decay_chunk` elements, the layout's param alignment,
  counted from the bucket's start: `shift` is how far into a chunk the shard starts). The optimizer builds
  flags only where no chunk holds a decayed and an undecayed param; padding takes any flag (its masters,
  grads and moments stay 0);
- clipping and the non-finite guard stay on the device, as torch's fused kernel takes them: grads are divided
  by `grad_scale` (>= 1; the division is exact at 1, so one launch serves both cases), and when `found_inf` is
  1 every program returns before touching memory;
- the formula is torch's fused AdamW's (`fused_adam_utils.cuh`, ADAMW mode) in its order: decay
  `p -= lr*wd*p`, `m = b1 m + (1-b1) g`, `v = b2 v + (1-b2) g g`, `p -= (lr/bc1) m / (sqrt(v)/sqrt(bc2) + eps)`,
  in fp32 where torch mixes in doubles for the scalars: equal to rounding, not bitwise
  (tests/trainer/kernels/test_adamw_triton.py states the tolerance);
- the bf16 param is the new master rounded to nearest even, the cast staging's `copy_` makes.

Imported lazily on CUDA only; importing it needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, q_ptr, flag_ptr, scale_ptr, found_ptr, n, shift, lr_wd, beta1,
                  one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, HAS_SCALE: tl.constexpr,
                  HAS_FOUND: tl.constexpr, PUBLISH: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    if HAS_FOUND:
        if tl.load(found_ptr) != 0.0:
            return
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = tl.math.div_rn(g, tl.load(scale_ptr))
    p = tl.load(p_ptr + offs, mask=ok, other=0.0)
    m = tl.load(m_ptr + offs, mask=ok, other=0.0)
    v = tl.load(v_ptr + offs, mask=ok, other=0.0)
    decayed = tl.load(flag_ptr + (offs + shift) // CHUNK, mask=ok, other=0) != 0
    p = tl.where(decayed, p - lr_wd * p, p)
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    denom = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - tl.math.div_rn(step_size * m, denom)
    tl.store(p_ptr + offs, p, mask=ok)
    tl.store(m_ptr + offs, m, mask=ok)
    tl.store(v_ptr + offs, v, mask=ok)
    if PUBLISH:
        tl.store(q_ptr + offs, p.to(q_ptr.dtype.element_ty), mask=ok)


def adamw_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           decay_flags: torch.Tensor, decay_chunk: int, shift: int = 0, *, step: int, lr: float, beta1: float,
           beta2: float, eps: float, weight_decay: float, grad_scale: torch.Tensor | None = None,
           found_inf: torch.Tensor | None = None, publish: torch.Tensor | None = None) -> None:  # fmt: skip
    """One AdamW step in place on flat fp32 `master`, `exp_avg`, `exp_avg_sq` from flat `grad` (any float dtype).

    `decay_flags`: uint8, one per `decay_chunk` elements (nonzero: decayed), flag c covering elements
    [c*chunk - shift, (c+1)*chunk - shift). `step`: 1-based, after this update.
    `grad_scale` / `found_inf`: float32 device scalars as `torch._fused_adamw_` takes them. `publish`: a flat
    tensor of the master's size that also receives the new master, cast to its dtype.
    """
    n = master.numel()
    flat = (master, grad, exp_avg, exp_avg_sq) + (() if publish is None else (publish,))
    if any(t.dim() != 1 or t.numel() != n or not t.is_contiguous() for t in flat):
        raise ValueError(f"fused AdamW takes flat contiguous tensors of one size: {[tuple(t.shape) for t in flat]}")
    if master.dtype != torch.float32 or exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
        raise ValueError("fused AdamW keeps fp32 masters and moments")
    chunks = triton.cdiv(n + shift, decay_chunk)
    if not 0 <= shift < decay_chunk or decay_flags.dtype != torch.uint8 or decay_flags.numel() != chunks:
        raise ValueError(f"fused AdamW: {decay_flags.numel()} decay flags for {n} elements at shift {shift}")
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    if n == 0:
        return
    bc1 = 1 - beta1**step  # Python doubles, as torch computes them from its step
    bc2 = 1 - beta2**step
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        master, grad, exp_avg, exp_avg_sq, master if publish is None else publish, decay_flags,
        master if grad_scale is None else grad_scale, master if found_inf is None else found_inf, n, shift,
        lr * weight_decay, beta1, 1 - beta1, beta2, 1 - beta2, lr / bc1, bc2**0.5, eps,
        HAS_SCALE=grad_scale is not None, HAS_FOUND=found_inf is not None, PUBLISH=publish is not None,
        CHUNK=decay_chunk, BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
