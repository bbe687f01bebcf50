"""The collectives of expert parallelism, with autograd: all-to-all, all-gather and reduce-scatter of rows.

Each backward is the plain transpose of its forward and is never scaled:

    all_to_all(x, out_splits, in_splits)   backward: all_to_all(grad, in_splits, out_splits)
    all_gather_rows(x)                      backward: reduce-scatter (SUM) of the grad
    reduce_scatter_rows(x)                  backward: all-gather of the grad

So the weight grad of an expert on its owner is the unscaled sum of the contributions of every ep rank's
tokens; `DistributedModel` then scales expert grads by 1/dp like dense ones (Megatron's rule), which
averages them over the global batch. Scaling here as well would divide twice.

On a one-rank group (`group.pg is None`) each is the identity, with no collective. Every rank of the group
must call the same collectives in the same order (forward and backward): the dispatchers guarantee it,
since every rank runs the same layers on the same number of micro-batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from trainer.parallel import comm

if TYPE_CHECKING:
    from trainer.parallel.groups import Group


def _a2a(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: "Group") -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=group.pg)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: "Group",
        during_backward: Optional[Callable[[], None]],
    ) -> torch.Tensor:  # fmt: skip
        ctx.splits, ctx.group, ctx.during = (out_splits, in_splits), group, during_backward
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        if ctx.during is None:
            return _a2a(grad, in_splits, out_splits, ctx.group), None, None, None, None
        grad = grad.contiguous()
        out = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        work = dist.all_to_all_single(out, grad, list(in_splits), list(out_splits), group=ctx.group.pg,
                                      async_op=True)  # fmt: skip
        ctx.during()  # e.g. the expert weight grads (delayed wgrad) while the data grads are on the wire
        work.wait()
        return out, None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: "Group",
               during_backward: Optional[Callable[[], None]] = None) -> torch.Tensor:  # fmt: skip
    """Rows `x[sum(in_splits[:r]) : ...+in_splits[r]]` go to rank r; rank s's rows for us land in block s.

    `in_splits[r]`: rows of `x` sent to rank r (summing to `x.shape[0]`); `out_splits[s]`: rows received
    from rank s. Differentiable; split sizes are host ints (the caller synced them). `during_backward`
    runs in the backward while the reverse all-to-all is in flight (launched async, waited after it).
    """
    if group.pg is None:
        return x
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group, during_backward)


def all_to_all_counts(counts: torch.Tensor, group: "Group") -> torch.Tensor:
    """Equal-split all-to-all of a 1-D integer tensor (`group.size` equal blocks), without autograd."""
    if group.pg is None:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group.pg)
    return out


def _gather(x: torch.Tensor, group: "Group") -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
    comm.all_gather(out, x, group)
    return out


def _scatter(x: torch.Tensor, group: "Group") -> torch.Tensor:
    x = x.contiguous()
    if x.shape[0] % group.size:
        raise ValueError(f"reduce-scatter of {x.shape[0]} rows over {group.size} ranks: rows must split evenly")
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
    comm.reduce_scatter(out, x, group)
    return out


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, group: "Group", during_backward: Optional[Callable[[], None]]
    ) -> torch.Tensor:
        ctx.group, ctx.during = group, during_backward
        return _gather(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if ctx.during is None:
            return _scatter(grad, ctx.group), None, None
        grad = grad.contiguous()
        if grad.shape[0] % ctx.group.size:
            raise ValueError(f"reduce-scatter of {grad.shape[0]} rows over {ctx.group.size} ranks: rows must split evenly")
        out = grad.new_empty((grad.shape[0] // ctx.group.size, *grad.shape[1:]))
        work = comm.reduce_scatter(out, grad, ctx.group, async_op=True)
        ctx.during()  # e.g. the expert weight grads (delayed wgrad) while the data grads are reduced
        if work is not None:
            work.wait()
        return out, None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: "Group") -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _scatter(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return _gather(grad, ctx.group), None


def all_gather_rows(x: torch.Tensor, group: "Group",
                    during_backward: Optional[Callable[[], None]] = None) -> torch.Tensor:  # fmt: skip
    """Every rank's `x` (same shape everywhere) stacked along dim 0 in group order; differentiable.
    `during_backward` runs while the backward's reduce-scatter is in flight (as `all_to_all`'s)."""
    if group.pg is None:
        return x
    return _AllGatherRows.apply(x, group, during_backward)


def all_gather_rows_nograd(x: torch.Tensor, group: "Group") -> torch.Tensor:
    """`all_gather_rows` for tensors without grad (expert ids)."""
    return x if group.pg is None else _gather(x, group)


def reduce_scatter_rows(x: torch.Tensor, group: "Group") -> torch.Tensor:
    """Sum `x` over the group and keep this rank's block of `x.shape[0] / group.size` rows; differentiable."""
    if group.pg is None:
        return x
    return _ReduceScatterRows.apply(x, group)
