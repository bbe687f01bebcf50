"""`moe.delay_wgrad_compute`: the expert MLP's weight grads computed after its data grads, as Megatron does.

Without it, an expert backward computes `dx` and the weight (and bias) grads together. With it, the
backend's `backward_dgrad` computes only what flows on (`dx`, `dprobs`) and hands back a closure for the
rest; `GroupedMLP` defers that closure to its layer's `DelayedWgrad`, and autograd carries `dx` on to the
dispatcher's backward. There the deferred grads run while the data grads travel:

    all-to-all dispatcher   its all-to-all of `dx` back to the tokens' ranks is launched async, the weight
                            grads are computed meanwhile, then the all-to-all is waited (Megatron's overlap of
                            the expert wgrad with the EP all-to-all; `ep_comm.all_to_all(during_backward=)`)
    all-gather dispatcher   likewise around the reduce-scatter of the gathered tokens' grads
    local (ep = 1)          at the backward of an identity on the expert input (`flush_point`): right after
                            `dx`, nothing to overlap (rule MOE025 warns)

A backstop queued on autograd's engine runs whatever is still pending at the end of the backward pass (an
expert input without grad never reaches a flush point), so no weight grad is ever lost.

The deferred grads are accumulated and their grad hooks fired as autograd would have
(`trainer.main_grad.accumulate_late_wgrad`): fused into `main_grad` with `grad_ready`, or through `.grad`
and the params' post-accumulate hooks, so the bucketed grad reduce sees every expert param report once per
backward, and `overlap_grad_reduce` launches their buckets (seed 004: delayed wgrad must still fire the
grad-reduce hooks). The same GEMMs on the same operands, accumulated in the same order: bitwise the same
grads as without delay (tests/trainer/moe/test_delayed_wgrad.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


class DelayedWgrad:
    """The weight-grad closures one MoE layer's backward deferred, until its flush point runs them."""

    def __init__(self) -> None:
        self._pending: list[Callable[[], None]] = []
        #: flushes that ran something (tests read it to see where the grads were computed)
        self.flushes = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def defer(self, fn: Callable[[], None]) -> None:
        """Keep `fn` (computes and delivers weight grads) for the flush point; called inside a backward."""
        self._pending.append(fn)
        # The backstop: run at the end of this backward pass if no flush point did it first.
        torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def flush(self) -> None:
        """Run every deferred closure, oldest first (a no-op when none is pending)."""
        if not self._pending:
            return
        self.flushes += 1
        while self._pending:
            self._pending.pop(0)()


class _FlushPoint(torch.autograd.Function):
    """Identity forward; backward runs the deferred weight grads, then passes the grad on unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, flush: Callable[[], None]) -> torch.Tensor:  # type: ignore[override]
        ctx.flush = flush
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:  # type: ignore[override]
        ctx.flush()
        return grad, None


def flush_point(x: torch.Tensor, flush: Optional[Callable[[], None]]) -> torch.Tensor:
    """`x`, with `flush` run in the backward once `x`'s grad is known (no-op for None or no grad)."""
    if flush is None or not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _FlushPoint.apply(x, flush)
