"""The language-model loss: mean next-token cross-entropy of bf16 logits, computed in fp32.

`F.cross_entropy(logits.float(), targets)` is the definition (and the path off CUDA). On CUDA with Triton
(`kernels/cross_entropy_triton.py`) it is a custom op, `lm_cross_entropy`, which the compiled loss region calls
as it is (off CUDA the op runs as torch ops, for the tests): the forward reads each row of logits once (an
online max and sum of exponentials in fp32) and keeps each row's log-sum-exp; the backward reads the row again
and writes `(softmax - one_hot) * grad / count` in the logits' dtype. Inductor's compile of the definition
read the `[B*S, V]` logits at ~1.3 TB/s forward (~390 us per micro-batch at the reference shape on an H100;
docs/benchmarks.md). Targets equal to `IGNORE_INDEX` count for
nothing, as in `F.cross_entropy`; the mean is over the others (NaN when there are none).
`MOECTL_TRITON_CROSS_ENTROPY=0` keeps the definition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.kernels import triton_runs

IGNORE_INDEX = -100  # F.cross_entropy's default


def fast_cross_entropy(device: torch.device) -> bool:
    """Whether the loss takes the Triton op on `device`."""
    return triton_runs(device, "MOECTL_TRITON_CROSS_ENTROPY")


def cross_entropy(logits_NV: torch.Tensor, targets_N: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """Mean cross-entropy of `[N, V]` logits against `[N]` targets, in fp32. `fused`: the Triton op (CUDA)."""
    if fused:
        return lm_cross_entropy(logits_NV, targets_N)[0]
    return F.cross_entropy(logits_NV.float(), targets_N)


@torch.library.custom_op("moectl::lm_cross_entropy", mutates_args=())
def lm_cross_entropy(logits_NV: torch.Tensor,
                     targets_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`(loss, lse_N, count)`: the mean loss (fp32 scalar), each row's log-sum-exp (fp32) and the number of
    counted targets (int64 scalar), the last two for the backward. The Triton kernels on CUDA, torch's ops
    elsewhere (what the CPU tests run)."""
    counted_N = targets_N != IGNORE_INDEX
    if logits_NV.is_cuda:
        from trainer.kernels.cross_entropy_triton import cross_entropy_forward

        loss_N, lse_N = cross_entropy_forward(logits_NV, targets_N, IGNORE_INDEX)
    else:
        x = logits_NV.float()
        lse_N = torch.logsumexp(x, dim=-1)
        picked = x.gather(1, torch.where(counted_N, targets_N, 0)[:, None])[:, 0]
        loss_N = torch.where(counted_N, lse_N - picked, 0.0)
    count = counted_N.sum()
    return loss_N.sum() / count, lse_N, count


@lm_cross_entropy.register_fake
def _(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = logits_NV.shape[0]
    return (logits_NV.new_empty((), dtype=torch.float32), logits_NV.new_empty((n,), dtype=torch.float32),
            targets_N.new_empty((), dtype=torch.int64))  # fmt: skip


@torch.library.custom_op("moectl::lm_cross_entropy_backward", mutates_args=())
def lm_cross_entropy_backward(grad: torch.Tensor, logits_NV: torch.Tensor, targets_N: torch.Tensor,
                              lse_N: torch.Tensor, count: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The logits' grad `(softmax - one_hot) * grad / count` in the logits' dtype (zero on ignored rows)."""
    scale = grad.float() / count  # a device scalar: no host sync
    if logits_NV.is_cuda:
        from trainer.kernels.cross_entropy_triton import cross_entropy_backward

        return cross_entropy_backward(logits_NV, targets_N, lse_N, scale, IGNORE_INDEX)
    counted_N = targets_N != IGNORE_INDEX
    d = torch.exp(logits_NV.float() - lse_N[:, None])
    d[torch.arange(d.shape[0]), torch.where(counted_N, targets_N, 0)] -= counted_N.float()
    return (d * torch.where(counted_N, scale, 0.0)[:, None]).to(logits_NV.dtype)


@lm_cross_entropy_backward.register_fake
def _(grad: torch.Tensor, logits_NV: torch.Tensor, targets_N: torch.Tensor, lse_N: torch.Tensor,
      count: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return logits_NV.new_empty(logits_NV.shape)  # contiguous, as the kernels write it


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    logits_NV, targets_N = inputs
    _, lse_N, count = output
    ctx.mark_non_differentiable(lse_N, count)  # the backward's inputs, not results to differentiate
    ctx.save_for_backward(logits_NV, targets_N, lse_N, count)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor, *_: object) -> tuple:
    logits_NV, targets_N, lse_N, count = ctx.saved_tensors
    return lm_cross_entropy_backward(grad, logits_NV, targets_N, lse_N, count), None


lm_cross_entropy.register_autograd(_backward, setup_context=_setup)
