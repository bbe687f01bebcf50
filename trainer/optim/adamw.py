"""AdamW on flat fp32 tensors: torch's formula, in torch's order.

`adamw_update_` repeats, op for op, the non-capturable single-tensor path of `torch.optim.AdamW`
(`torch/optim/adam.py`, `_single_tensor_adam` with decoupled weight decay; the foreach path computes the
same ops): decay `p *= 1 - lr*wd`, `m.lerp_(g, 1-b1)`, `v = v*b2 + (1-b2) g*g`, then
`p.addcdiv_(m, sqrt(v)/sqrt(bc2) + eps, value=-lr/bc1)` with the bias corrections computed in Python
doubles from the step count. Every op is elementwise, so running it on a flat shard gives each element
the bits it gets from torch on the full tensor: tests check bitwise equality on CPU against
`torch.optim.AdamW(foreach=False)` and `foreach=True`.

`fused_adamw_update_` calls the kernel behind `torch.optim.AdamW(fused=True)` (`torch._fused_adamw_`,
CPU and CUDA) on lists of flat tensors; it is bitwise equal to that optimizer, not to the unfused one
(the fused kernel evaluates the same formula in one pass, with different rounding).

Weight decay applies only to the element ranges in `decay_ranges` (None: all), because a flat shard
mixes matrices (decayed) with norms and biases (not decayed).
"""

from __future__ import annotations

from typing import Sequence

import torch


def adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decay_ranges: Sequence[tuple[int, int]] | None = None,
) -> None:
    """One AdamW step in place; `step` is the 1-based count after this update (torch's `state["step"]`)."""
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    if weight_decay != 0:
        factor = 1 - lr * weight_decay
        if decay_ranges is None:
            param.mul_(factor)
        else:
            for a, b in decay_ranges:
                param[a:b].mul_(factor)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    s = float(step)  # torch reads its float step tensor with .item()
    bias_correction1 = 1 - beta1**s
    bias_correction2 = 1 - beta2**s
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def fused_adamw_update_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    step: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One fused AdamW step over lists of tensors; `step` is a float32 scalar tensor already incremented.

    `grad_scale` (float32 scalar on the device): grads are divided by it, and the kernel stores the divided
    grads back. `found_inf` (float32 scalar, 0.0 or 1.0): at 1.0 the kernel changes nothing at all.
    """
    if not params:
        return
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        [step] * len(params),
        amsgrad=False,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )
