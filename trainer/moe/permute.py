"""Moving rows between token order and expert order with gathers only, in both directions.

Dispatch sends the N = T*K routings of T tokens (token-major: routing n is token n // K) to rows of the
expert input `x_PD`; combine brings the expert outputs back and sums each token's K rows. Written with
autograd's own ops, the backward of the first gather is a scatter-add over tokens and the combine is an
`index_put` into a zero buffer - on CUDA the deterministic scatter-add sorts its indices, which made
`index_put` 10% of a bf16 training step. Both directions here are gathers plus a K-way sum in a fixed
order, so forward and backward are deterministic and move each row once.

    row_N  the row of x_PD each routing went to, or P for a dropped one (it reads a zero row)
    src_P  the routing each row of x_PD holds, or N for a padding row (it reads a zero row)

The zero row is appended (a copy of the tensor it extends) only where a plan has padding rows (`padded`)
or dropped routings (`dropped`); a dropless, unpadded plan gathers the tensors as they are.

The gather-and-sum (combine forward, dispatch backward) runs as one Triton kernel on CUDA
(`kernels/gather_sum_triton.py`: no `[N, D]` intermediate, dropped routings read as zeros without the
appended row); `MOECTL_TRITON_GATHER_SUM=0` keeps the torch ops.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.kernels import triton_runs


def _with_zero_row(t_XD: torch.Tensor) -> torch.Tensor:
    """`t` with one zero row appended: the target of dropped routings and padding rows."""
    return torch.cat([t_XD, t_XD.new_zeros(1, t_XD.shape[1])])


def _gather(t_XD: torch.Tensor, index: torch.Tensor, zero_row: bool) -> torch.Tensor:
    return (_with_zero_row(t_XD) if zero_row else t_XD).index_select(0, index)


def _gather_sum(t_XD: torch.Tensor, index_N: torch.Tensor, topk: int, zero_row: bool) -> torch.Tensor:
    """`[N / K, D]`: the K rows `index_N` picks for each output row, summed in fp32 in order k = 0..K-1."""
    if topk == 1:  # a plain row gather (the all-to-all's receiver side): nothing to sum
        return _gather(t_XD, index_N, zero_row)
    if triton_runs(t_XD.device, "MOECTL_TRITON_GATHER_SUM"):
        from trainer.kernels.gather_sum_triton import gather_sum

        return gather_sum(t_XD.contiguous(), index_N, topk)  # an index X (dropped) reads zeros
    return _gather(t_XD, index_N, zero_row).view(index_N.numel() // topk, topk, t_XD.shape[1]).sum(dim=1)


class _Dispatch(torch.autograd.Function):
    """x_PD[p] = x_TD[src_P[p] // K] (0 for padding); grad: each token sums the grads of its K rows."""

    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, src_P: torch.Tensor, row_N: torch.Tensor, topk: int,
                padded: bool, dropped: bool) -> torch.Tensor:
        ctx.save_for_backward(row_N)
        ctx.topk, ctx.dropped = topk, dropped
        token_P = src_P // topk if topk > 1 else src_P  # padding rows (src N) land on token T: the zero row
        return _gather(x_TD, token_P, padded)

    @staticmethod
    def backward(ctx: Any, g_PD: torch.Tensor) -> tuple[Any, ...]:
        (row_N,) = ctx.saved_tensors
        return _gather_sum(g_PD, row_N, ctx.topk, ctx.dropped), None, None, None, None, None


class _Combine(torch.autograd.Function):
    """y_TD[t] = sum_k y_PD[row_N[t*K + k]] (0 for dropped routings); grad: each row reads its token's grad."""

    @staticmethod
    def forward(ctx: Any, y_PD: torch.Tensor, src_P: torch.Tensor, row_N: torch.Tensor, topk: int,
                padded: bool, dropped: bool) -> torch.Tensor:
        ctx.save_for_backward(src_P)
        ctx.topk, ctx.padded = topk, padded
        return _gather_sum(y_PD, row_N, topk, dropped)

    @staticmethod
    def backward(ctx: Any, g_TD: torch.Tensor) -> tuple[Any, ...]:
        (src_P,) = ctx.saved_tensors
        token_P = src_P // ctx.topk if ctx.topk > 1 else src_P
        return _gather(g_TD, token_P, ctx.padded), None, None, None, None, None


def dispatch_rows(x_TD: torch.Tensor, src_P: torch.Tensor, row_N: torch.Tensor, topk: int, padded: bool,
                  dropped: bool) -> torch.Tensor:
    """The expert input `[P, D]`: row p holds token `src_P[p] // K` (zeros where `padded` rows have src N;
    `dropped`: some routings have no row, row_N = P)."""
    return _Dispatch.apply(x_TD, src_P, row_N, topk, padded, dropped)


def combine_rows(y_PD: torch.Tensor, src_P: torch.Tensor, row_N: torch.Tensor, topk: int, padded: bool,
                 dropped: bool) -> torch.Tensor:
    """Each token's K expert output rows summed, in a fixed order: `[T, D]`."""
    return _Combine.apply(y_PD, src_P, row_N, topk, padded, dropped)
