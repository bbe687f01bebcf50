"""Zeroing grads flagged stale: `settle_stale_` for a writer that adds (every one but the expert wgrad kernels,
which overwrite), and the guard that makes grads still flagged at the end of a backward read as zero.

`zero_grad` leaves a stale-capable grad unfilled and flags it (`trainer/main_grad.py`); its layer overwrites
it in the step. If that layer's backward did not run (a layer skipped in a step, a loss that does not reach
it), the leftovers of the last step would be reduced and stepped on. `StaleGuard.zero_unwritten_` runs
before a bucket's grads are reduced or read, with no host sync: on CUDA one Triton launch that reads each
chunk's flag and stores zeros only where it is still set (`stale_zero_triton.py`); elsewhere `settle_stale_`
(a masked fill of each range).
"""

from __future__ import annotations

from typing import Sequence

import torch

from trainer.kernels import has_triton


def settle_stale_(targets: Sequence[torch.Tensor], stale: Sequence[torch.Tensor]) -> None:
    """Zero each target whose one-element int32 flag is set, then clear the flags: what a writer that cannot
    overwrite does first (a pass over each target, no host sync). `masked_fill`, not a product with the flag:
    leftovers may be inf/NaN."""
    for target, flag in zip(targets, stale):
        target.masked_fill_(flag.bool(), 0.0)
    clear_flags_(stale)


def clear_flags_(stale: Sequence[torch.Tensor]) -> None:
    """Clear each distinct flag once (a grouped param's E targets share one)."""
    distinct = list({f.data_ptr(): f for f in stale}.values())
    torch._foreach_zero_(distinct)


class StaleGuard:
    """The flagged params of one bucket group: their ranges in the grad buffer and their flags' indices."""

    def __init__(self, grad: torch.Tensor, flags: torch.Tensor, ranges: Sequence[tuple[int, int, int]]) -> None:
        """`ranges`: (start, end, flag index) of each flagged param in `grad` (the buffer's fp32 grad_data)."""
        self.grad, self.flags = grad, flags
        self.ranges = list(ranges)
        self._chunks: torch.Tensor | None = None  # made on first use, kept: the ranges never move
        self._flag_index: torch.Tensor | None = None

    def zero_unwritten_(self) -> None:
        """Zero the params whose flag is still set, then clear those flags (stream-ordered, no host sync on CUDA)."""
        if not self.ranges:
            return
        if self.grad.is_cuda and has_triton():
            from trainer.kernels import stale_zero_triton as kernel  # lazy: needs Triton

            if self._chunks is None:
                rows = []
                for start, end, f in self.ranges:
                    rows += [(lo, min(kernel.CHUNK, end - lo), f) for lo in range(start, end, kernel.CHUNK)]
                self._chunks = torch.tensor(rows, dtype=torch.int64).to(self.grad.device)
            kernel.zero_stale_chunks_(self.grad, self._chunks, self.flags)
            if self._flag_index is None:
                self._flag_index = torch.tensor([f for _, _, f in self.ranges], dtype=torch.int64).to(self.flags.device)
            # only this group's flags: another group's params may not have been written yet in this backward
            self.flags.index_fill_(0, self._flag_index, 0)
        else:
            settle_stale_([self.grad[s:e] for s, e, _ in self.ranges], [self.flags[f:f + 1] for _, _, f in self.ranges])
