"""`moe.defer_expert_wgrad`: the expert weight grads of a step's micro-batches computed once, at the last one.

Each micro-batch's expert wgrad reads and writes every fp32 expert grad (8 B an element) for the ~1k rows an
expert gets per micro-batch: memory-bound at the reference shapes (fc1: 2.67 ms for four micro-batches,
412 TFLOP/s, on an H100). Deferred, the backward of every micro-batch but the last keeps the wgrad's operands
(`x`, `dh`, the activation and `dy`: 470 MB per layer and micro-batch at the reference shapes) in its layer's
`WgradStash`, and every fourth (`GROUP`, the kernel's sources per launch) and the last sum the kept
micro-batches' products with their own per tile in one fp32 accumulator and add them into the grad once
(`grouped_wgrad.accumulate_grouped_wgrad_(earlier=)`: 2.16 ms, 508 TFLOP/s). The price is that memory: up to
three micro-batches' operands live until the next flush. The grads are the same sums in
another order (fp32 throughout), not bitwise those of the undeferred step.

    the loop       says which backward defers and which flushes (`defers`, `micro_batch_phase`); after the
                   last micro-batch nothing may be left (`check_flushed`)
    the experts    stash in a deferring backward, flush in the last (`GroupedMLP`, `backends/fused.py`)
    zero_grad      drops every stash (`clear_all`): an interrupted step's operands never reach the next step
    CUDA graphs    each micro-batch is a variant of its own, so kept operands sit at addresses no other
                   variant writes before the flush that reads them, and each flush reads its own group's
                   (`graphs/capture.py`)
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional

#: micro-batches per flush: the kernel sums up to four sources per launch, so a flush every fourth micro-batch
#: saves as much as one at the end, and keeps at most three micro-batches' operands at a time
GROUP = 4

_phase: Optional[bool] = None  # True: the running backward defers; False: it flushes; None: no deferral
_stashes: "weakref.WeakSet[WgradStash]" = weakref.WeakSet()


@contextlib.contextmanager
def micro_batch_phase(defer: Optional[bool]) -> Iterator[None]:
    """Run the block's backwards deferring (`True`: a step's micro-batch but the last), flushing (`False`: the
    last) or as usual (`None`). A module global, not a thread-local: autograd runs CUDA backwards on its own
    threads, and `.backward()` returns only once they are done."""
    global _phase
    prev, _phase = _phase, defer
    try:
        yield
    finally:
        _phase = prev


def defers(micro: int, n_micro: int) -> bool:
    """Whether micro-batch `micro` (0-based) of `n_micro` keeps its operands: all but every `GROUP`-th and the last."""
    return micro != n_micro - 1 and micro % GROUP != GROUP - 1


def phase() -> Optional[bool]:
    """What the running backward does with deferrable expert wgrads (see `micro_batch_phase`)."""
    return _phase


class WgradStash:
    """One expert MLP's deferred wgrad operands, one entry per deferring micro-batch, oldest first."""

    def __init__(self) -> None:
        self.entries: list[Any] = []
        _stashes.add(self)

    def __deepcopy__(self, memo: dict) -> "WgradStash":
        return WgradStash()  # a copied layer (a bench's model copy) gets its own, registered, empty stash

    def defer(self, entry: Any) -> None:
        self.entries.append(entry)

    def take(self) -> list[Any]:
        """Every entry, oldest first; the stash is empty after."""
        entries, self.entries = self.entries, []
        return entries


def clear_all() -> None:
    """Drop every stash's entries (the grads they were for are being zeroed)."""
    for stash in list(_stashes):
        stash.entries.clear()


def check_flushed() -> None:
    """Raise if a stash still holds operands after a step's last backward: their grads would be lost."""
    left = sum(len(s.entries) for s in list(_stashes))
    if left:
        raise RuntimeError(
            f"moe.defer_expert_wgrad: {left} deferred expert wgrad(s) were never flushed by the step's last "
            "backward (an expert layer that ran in an earlier micro-batch did not run in the last)"
        )
