"""The weight-grad seam between layers and the distributed buffers.

A parameter may carry `main_grad`: an fp32 view into a contiguous grad buffer (set by
`trainer.distributed`, or by a test). Layers that compute weight grads themselves (the grouped expert
MLP under `gradient_accumulation_fusion`) accumulate straight into it and leave `.grad` unused, then
call `grad_ready(param)` so an overlapped reduce can start as soon as a bucket is complete. Layers that
go through plain autograd leave `.grad`, and the buffer's post-accumulate hook moves it into
`main_grad` and calls the same `grad_ready`. Either way every parameter reports exactly once per
backward, which is what bucket bookkeeping counts.

Stale grads: a param may also carry `main_grad_stale` (STALE_ATTR), an int32 one-element device flag. The
buffer's `zero_grad` sets it instead of zero-filling that `main_grad` (`trainer/distributed/buffers.py`):
while it is set, `main_grad` holds leftovers that read as zero. The expert weight grads' writer overwrites a
flagged grad in its own kernel and clears the flag (`trainer/kernels/grouped_wgrad.py`); on the reference
step that saves the fill's write and the first micro-batch's read of every expert grad. Every other writer
settles first (`settle_stale`: zero where flagged, clear), so a grad is always right whoever writes it; only
params whose layer says its writer overwrites (`stale_grad_params`) are ever flagged.
"""

from __future__ import annotations

import torch

from trainer.kernels import fp32_out_gemm
from trainer.kernels.stale_zero import settle_stale_
from trainer.regions import GRAD_ACCUMULATE, region

READY_HOOK = "moectl_grad_ready_hook"
STALE_ATTR = "main_grad_stale"


def stale_flag(param: torch.Tensor) -> torch.Tensor | None:
    """`param`'s stale flag (see the module docstring), or None where its grad is always zero-filled."""
    return getattr(param, STALE_ATTR, None)


def settle_stale(param: torch.Tensor) -> None:
    """Make `param.main_grad` safe to add into: zero it where its stale flag is set, then clear the flag (no
    host sync). A no-op for a param without a flag (every param but stale-capable expert weights)."""
    flag = stale_flag(param)
    if flag is not None:
        settle_stale_([param.main_grad], [flag])  # type: ignore[attr-defined]


def require_main_grad(param: torch.Tensor) -> torch.Tensor:
    """`param.main_grad`, or the error that says how a fused layer gets one."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            "gradient_accumulation_fusion needs param.main_grad; wrap the model with trainer.distributed "
            "or call trainer.main_grad.attach_main_grads(model) first"
        )
    return main_grad


def accumulate_wgrad(param: torch.nn.Parameter, grad: torch.Tensor, fuse: bool,
                     report: bool = True) -> torch.Tensor | None:  # fmt: skip
    """Route one weight grad: into `param.main_grad` when `fuse` (returns None), else return it.

    `grad` is the grad for the whole parameter (same shape). Accumulation is in the buffer's dtype
    (fp32 by default), which is the point: micro-batch grads never round through bf16. `report` false: a
    part of this backward's grad, another part will report (a layer run on its rows in chunks).
    """
    if not fuse:
        return grad
    main_grad = require_main_grad(param)
    with region(GRAD_ACCUMULATE):
        settle_stale(param)
        main_grad.add_(grad)  # bf16 -> fp32 inside the add: a separate .to() would be one more full pass
    if report:
        grad_ready(param)
    return None


def accumulate_late_wgrad(param: torch.nn.Parameter, grad: torch.Tensor, fuse: bool) -> None:
    """Accumulate a weight grad computed after the backward pass handed `param` None (delayed wgrad), and
    fire its grad hooks, exactly as the grad would have been taken had it come back through autograd.

    `fuse`: into `main_grad` and report (`accumulate_wgrad`). Otherwise what autograd does with a leaf's
    grad: cast to the param's dtype, accumulate into `.grad` (in place when one exists), then run the
    param's post-accumulate hooks, which fold it into `main_grad` and report it under `trainer.distributed`
    (Megatron's delayed wgrad likewise triggers the params' grad-accumulation and reduce hooks itself).
    """
    if fuse:
        accumulate_wgrad(param, grad, fuse=True)
        return
    grad = grad.to(param.dtype)
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad.clone(memory_format=torch.contiguous_format)  # never a view of another grad
        else:
            param.grad.add_(grad)
    hooks = getattr(param, "_post_accumulate_grad_hooks", None) or {}
    for hook in list(hooks.values()):
        hook(param)


def accumulate_wgrad_mm(param: torch.nn.Parameter, dy_NO: torch.Tensor, x_NI: torch.Tensor) -> None:
    """`param.main_grad += dy^T x` for a linear weight `[O, I]`, the product accumulated in fp32, then report.

    On CUDA, cuBLAS adds the product into the fp32 buffer inside the GEMM (`addmm` with `out_dtype`, beta 1:
    Megatron's gradient-accumulation fusion): no bf16 grad is written, read back and added. Where this torch
    lacks that kernel (CPU, older builds) the product is computed in fp32 and added.
    """
    main_grad = param.main_grad  # type: ignore[attr-defined]
    settle_stale(param)
    if main_grad.dtype == torch.float32 and fp32_out_gemm(main_grad.device, "addmm"):
        torch.addmm(main_grad, dy_NO.t(), x_NI, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.addmm_(dy_NO.t().to(main_grad.dtype), x_NI.to(main_grad.dtype))
    grad_ready(param)


def grad_ready(param: torch.nn.Parameter) -> None:
    """Tell whoever owns `param`'s grad bucket that this backward's grad for it is complete."""
    hook = getattr(param, READY_HOOK, None)
    if hook is not None:
        hook(param)


def attach_main_grads(module: torch.nn.Module, dtype: torch.dtype = torch.float32) -> None:
    """Give every trainable parameter a zeroed `main_grad` of its own (single-device runs and tests).

    Plain-autograd grads are folded in by a post-accumulate hook, so the optimizer can always read
    `main_grad`. `trainer.distributed` replaces this with views into contiguous buffers.
    """
    for p in module.parameters():
        if not p.requires_grad or getattr(p, "main_grad", None) is not None:
            continue
        p.main_grad = torch.zeros_like(p, dtype=dtype)

        def fold(param: torch.Tensor) -> None:
            # torch runs this hook even when a fused Function returned None for the param; that
            # path already accumulated into main_grad and reported, so report only real grads.
            if param.grad is None:
                return
            settle_stale(param)
            param.main_grad.add_(param.grad.to(param.main_grad.dtype))
            param.grad = None
            grad_ready(param)  # type: ignore[arg-type]

        p.register_post_accumulate_grad_hook(fold)
