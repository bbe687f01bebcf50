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


def _a2a_async(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: "Group",
               out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Any]:  # fmt: skip
    """`_a2a` launched without waiting: `(out, work)`; `out` (the received rows' buffer) is allocated unless
    given. The caller waits on `work` before reading `out`."""
    x = x.contiguous()
    if out is None:
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=group.pg, async_op=True)
    return out, work


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
        out, work = _a2a_async(grad, in_splits, out_splits, ctx.group)
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


# --- an all-to-all split in two autograd nodes, so compute can run while it is in flight -------------------
class Landing:
    """One buffer for the rows of n chunked transfers, each landing in its own block, so the chunks (or their
    grads) join without a copy (`join_chunks`, `split_chunks`). Allocated when the first of them launches."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.buf: Optional[torch.Tensor] = None

    def block(self, index: int, like: torch.Tensor, rows: int) -> torch.Tensor:
        if self.buf is None or self.buf.shape[0] != rows * self.chunks:
            self.buf = like.new_empty((rows * self.chunks, *like.shape[1:]))
        return self.buf[index * rows:(index + 1) * rows]

    def holds(self, blocks: Sequence[Optional[torch.Tensor]]) -> bool:
        """Whether `blocks` are this buffer's blocks, in order (then the buffer is their concatenation)."""
        if self.buf is None or len(blocks) != self.chunks:
            return False
        rows = self.buf.shape[0] // self.chunks
        return all(b is not None and b.shape == (rows, *self.buf.shape[1:]) and b.stride() == self.buf.stride()
                   and b.data_ptr() == self.buf[i * rows:].data_ptr() for i, b in enumerate(blocks))  # fmt: skip


class Ticket:
    """One in-flight all-to-all between its start and its wait, in either direction (forward, then backward).
    `landing`: the forward's (`forward`) or the backward's (`backward`) received rows land in block `index`
    of it."""

    def __init__(self, index: int = 0, forward: Optional[Landing] = None, backward: Optional[Landing] = None) -> None:
        self.work: Any = None
        self.out: Optional[torch.Tensor] = None
        self.index, self.landings = index, {True: forward, False: backward}

    def launch(self, x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: "Group",
               forward: bool) -> None:  # fmt: skip
        landing = self.landings[forward]
        self.landings[forward] = None  # held by its user from here: autograd's ctx must not keep the buffer alive
        out = None if landing is None else landing.block(self.index, x, sum(out_splits))
        self.out, self.work = _a2a_async(x, out_splits, in_splits, group, out)

    def wait(self) -> torch.Tensor:
        """The received rows; the current stream waits for them (the host does not)."""
        assert self.out is not None, "waited on an all-to-all that was never started"
        if self.work is not None:
            self.work.wait()
        out, self.work, self.out = self.out, None, None
        return out


class _A2AStart(torch.autograd.Function):
    # forward: launch x's all-to-all. backward: wait for the reverse one `_A2AWait.backward` launched, and
    # return its rows as x's grad (the incoming grad is a placeholder that only orders the two nodes).
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: "Group", ticket: Ticket
    ) -> torch.Tensor:
        ctx.ticket = ticket
        ticket.launch(x, out_splits, in_splits, group, forward=True)
        return x.new_empty(0)  # a placeholder: the rows arrive at the wait

    @staticmethod
    def backward(ctx: Any, _placeholder: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return ctx.ticket.wait(), None, None, None, None


class _A2AWait(torch.autograd.Function):
    # forward: wait for the rows. backward: launch the reverse all-to-all of their grad and return at once.
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, _placeholder: torch.Tensor, out_splits: list[int], in_splits: list[int], group: "Group",
        ticket: Ticket,
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.ticket = (out_splits, in_splits), group, ticket
        return ticket.wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        ctx.ticket.launch(grad, in_splits, out_splits, ctx.group, forward=False)
        return grad.new_empty(0), None, None, None, None


def all_to_all_start(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: "Group",
                     ticket: Optional[Ticket] = None) -> tuple[torch.Tensor, Ticket]:  # fmt: skip
    """Launch `all_to_all(x, out_splits, in_splits)` without waiting: returns a placeholder to pass to
    `all_to_all_wait` (with the ticket) where the rows are first needed. Work queued in between overlaps the
    transfer, in the forward and, mirrored, in the backward: there the wait node launches the reverse
    all-to-all and the start node waits for it, and autograd runs the other chunks' nodes in between
    (it runs ready nodes latest-created first). One ticket per transfer (`ticket`: one with landings, else a
    new one); a one-rank group sends nothing."""
    ticket = ticket if ticket is not None else Ticket()
    if group.pg is None:
        ticket.out = x
        return x, ticket
    return _A2AStart.apply(x, list(out_splits), list(in_splits), group, ticket), ticket


def all_to_all_wait(placeholder: torch.Tensor, ticket: Ticket, out_splits: Sequence[int],
                    in_splits: Sequence[int], group: "Group") -> torch.Tensor:  # fmt: skip
    """The rows `all_to_all_start` launched, once arrived (differentiable; see there)."""
    if group.pg is None:
        return ticket.wait()
    return _A2AWait.apply(placeholder, list(out_splits), list(in_splits), group, ticket)


class _Join(torch.autograd.Function):
    # the landing's blocks as one tensor: its buffer (no copy); backward: the grad's blocks (views)
    @staticmethod
    def forward(ctx: Any, landing: Landing, *blocks: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.rows = [b.shape[0] for b in blocks]
        assert landing.buf is not None
        return landing.buf.view(landing.buf.shape)  # a view: the buffer's own autograd state stays untouched

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return (None, *grad.split(ctx.rows))


class _Split(torch.autograd.Function):
    # x's row blocks; backward: the landing's buffer when the blocks' grads landed in it in order (no copy)
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, rows: int, landing: Landing
    ) -> tuple[torch.Tensor, ...]:
        ctx.landing = landing
        return tuple(x.split(rows))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Any, ...]:  # type: ignore[override]
        landing, ctx.landing = ctx.landing, None  # the graph may outlive this backward: let the buffer go
        if landing.holds(grads):
            return landing.buf, None, None
        like = next(g for g in grads if g is not None)
        return torch.cat([g if g is not None else like.new_zeros(like.shape) for g in grads]), None, None


def join_chunks(blocks: Sequence[torch.Tensor], landing: Landing) -> torch.Tensor:
    """`torch.cat(blocks)`, without the copy when they are `landing`'s blocks in order (differentiable)."""
    if not landing.holds(blocks):
        return torch.cat(list(blocks))
    return _Join.apply(landing, *blocks)


def split_chunks(x: torch.Tensor, chunks: int, landing: Landing) -> tuple[torch.Tensor, ...]:
    """`x.split(rows)` into `chunks` blocks; in the backward, grads that landed in `landing` (a `Ticket`'s
    backward landing) join without the copy a split's backward makes."""
    if x.shape[0] % chunks:
        raise ValueError(f"{x.shape[0]} rows do not split into {chunks} equal chunks")
    return _Split.apply(x, x.shape[0] // chunks, landing)
