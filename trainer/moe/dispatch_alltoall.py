"""Expert-parallel token dispatch by all-to-all: each routing travels to the ep rank that owns its expert.

Shape suffixes: T tokens on this rank, D hidden, E experts in all, L = E/ep local experts, S rows this rank
sends (its routings sorted by global expert, after any capacity drop or pad), Q rows it receives, P rows of
the local experts' input (received rows grouped by local expert, each segment padded to `align`).

Experts are sharded contiguously: ep rank r owns global experts [r*L, (r+1)*L). One dispatch:

1. source side: `LocalDispatcher` over all E experts without alignment sorts this rank's routings by
   global expert (stable, so token order within an expert), dropping or padding by capacity exactly as
   on one device (capacity per source rank, from its own T, as Megatron's token drop). Because experts
   are contiguous per rank, rows for rank r are one contiguous block.
2. counts first: an equal-split all-to-all of the per-expert row counts (from the router's counts, before
   step 1 is queued) tells each rank how many rows every source sends for each of its experts. They come
   to the host through a non-blocking pinned copy the host waits on only once step 1's kernels are queued,
   so the one host sync per dispatch finds the GPU busy, not drained. With pad-to-capacity every source
   sends C_pad rows per expert: the splits are static, with no counts exchange and no host sync (what lets
   a CUDA graph hold the micro-batch, MOE058). That assumes every ep rank routes the same number of
   tokens T, as training and eval batches do (each rank's micro-batch has the same shape).
3. tokens: `all_to_all_single` of the rows (and, separately, of their fp32 probs) with those splits.
   Received rows are source-major (source 0's rows for local experts 0..L-1, then source 1's, ...).
4. receiver side: a row gather (`permute.dispatch_rows` with K = 1) regroups them expert-major and pads
   each local expert's segment to a multiple of `align` with zero rows of prob 0; within an expert, rows
   stay in (source rank, token) order, i.e. the order of the global batch, as on one device. Gathers in
   both directions: an `index_put` scatter wrote 2-byte elements one by one and its backward sorted.

`combine` runs the same steps backwards: gather each received row's output (`permute.combine_rows`, K = 1),
the reverse all-to-all,
then the source side's own combine (each token's K outputs summed in a fixed order). Autograd flows
through every step (`ep_comm.all_to_all`'s backward is the reverse all-to-all, unscaled).

Alignment happens once, on the receiver, over the rows of all sources: fewer pad rows than padding per
source, and none on the wire. `router_padding_for_quantization` therefore needs nothing extra here.
Host syncs: one per dispatch (the split sizes) unless padded to capacity, plus the source side's own when it
drops without padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from moectl.core.arith import round_up
from moectl.core.errors import ConfigError
from trainer.host_copy import to_host_later
from trainer.moe.dispatch import DispatchPlan, LocalDispatcher
from trainer.moe.ep_comm import (Landing, Ticket, all_to_all, all_to_all_counts, all_to_all_start, all_to_all_wait,
                                 join_chunks, split_chunks)  # fmt: skip
from trainer.moe.permute import combine_rows, dispatch_rows
from trainer.moe.router import RouterOutput
from trainer.parallel import comm

if TYPE_CHECKING:
    from trainer.parallel.groups import Group

#: the experts of a layer as the chunked path calls them: (x_PD, rows_per_expert_E, probs_P, rows_each) -> y_PD
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[int]], torch.Tensor]


@dataclass
class AllToAllPlan:
    """What `combine` needs to send expert outputs back and un-permute them."""

    source: DispatchPlan  # this rank's sort of its own routings (by global expert)
    send_splits: list[int]  # rows sent to each ep rank
    recv_splits: list[int]  # rows received from each ep rank
    dest_Q: torch.Tensor  # row of x_PD for each received row
    src_P: torch.Tensor  # received row each row of x_PD holds, Q for a padding row
    num_rows: int  # P
    tokens_per_expert_E: torch.Tensor  # received rows per local expert, before alignment padding (int64, [L])
    rows_per_expert_E: torch.Tensor  # rows per local expert in x_PD, padding included (int64, [L])

    @property
    def num_dropped(self) -> torch.Tensor:
        """Routings of this rank's tokens dropped by the capacity (int64 scalar)."""
        return self.source.num_dropped


def check_divisible(num_experts: int, ep: int) -> None:
    if ep < 1 or num_experts % ep:
        raise ConfigError(
            "moe.num_experts", num_experts, f"must be divisible by parallel.expert_model_parallel_size ({ep})",
            "make parallel.expert_model_parallel_size a divisor of moe.num_experts",
        )  # fmt: skip


def expert_major(
    counts_SL: torch.Tensor, counts_host: list[int], align: int
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """Where each source-major received row goes in the expert-major, padded layout.

    `counts_SL[s, l]`: rows from source s for local expert l (device), `counts_host` the same flattened
    on the host. Returns `(dest_Q, src_P, P, tokens_L, rows_L)`: `src_P` inverts `dest_Q`, Q on padding.
    """
    S, L = counts_SL.shape
    tokens_L = counts_SL.sum(0)
    rows_L = round_up(tokens_L, align)
    per_expert = [sum(counts_host[s * L + e] for s in range(S)) for e in range(L)]
    P = sum(round_up(n, align) for n in per_expert)
    Q = sum(counts_host)
    row_start_L = torch.cumsum(rows_L, 0) - rows_L
    before_SL = torch.cumsum(counts_SL, 0) - counts_SL  # rows of earlier sources in the same expert
    dest_start = (row_start_L.unsqueeze(0) + before_SL).reshape(-1)
    flat = counts_SL.reshape(-1)
    recv_start = torch.cumsum(flat, 0) - flat
    seg_Q = torch.repeat_interleave(torch.arange(S * L, device=flat.device), flat, output_size=Q)
    arange_Q = torch.arange(Q, device=flat.device)
    dest_Q = dest_start[seg_Q] + arange_Q - recv_start[seg_Q]
    src_P = torch.full((P,), Q, dtype=torch.int64, device=flat.device).index_put_((dest_Q,), arange_Q)
    return dest_Q, src_P, P, tokens_L, rows_L


class AllToAllDispatcher:
    """`LocalDispatcher`'s interface over experts sharded on the ep group; `rows_per_expert_E` is per local expert."""

    def __init__(
        self,
        num_experts: int,
        ep_group: "Group",
        *,
        align: int = 1,
        capacity_factor: Optional[float] = None,
        pad_to_capacity: bool = False,
        chunks: int = 1,
    ) -> None:
        check_divisible(num_experts, ep_group.size)
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        self.num_experts = num_experts
        self.group = ep_group
        self.num_local_experts = num_experts // ep_group.size
        self.first_expert = ep_group.rank * self.num_local_experts
        self.align = align
        self.chunks = chunks
        self.source = LocalDispatcher(num_experts, align=1, capacity_factor=capacity_factor,
                                      pad_to_capacity=pad_to_capacity, chunks=chunks)
        self._same_T: set[int] = set()  # token counts every ep rank was checked to route alike (static splits)

    def rows_per_expert(self, T: int, K: int) -> Optional[int]:
        """Every local expert's input rows when the config fixes them: under drop-and-pad each of the ep
        sources sends it C_pad rows, padded on arrival to a multiple of `align`, so recipes' grouped GEMMs
        split them without a host read, as on one rank. Else None: they depend on what the other ranks send."""
        C_pad = self.source.rows_per_expert(T, K)
        return None if C_pad is None else round_up(self.group.size * C_pad, self.align)

    def dispatch(
        self, x_TD: torch.Tensor, router_out: RouterOutput, flush: Optional[Callable[[], None]] = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AllToAllPlan]:
        """`(x_PD, rows_per_expert_E, probs_P, plan)` for this rank's local experts (rows from every ep rank).

        `flush` (delayed expert wgrad) runs in the backward while the rows' grads are all-to-all'ed back."""
        ep, L = self.group.size, self.num_local_experts
        T, K = router_out.indices_TK.shape
        C_pad = self.source.rows_per_expert(T, K)
        if C_pad is not None:  # padded to capacity: every source sends C_pad rows per expert (equal T everywhere)
            self._check_same_T(T, x_TD.device)
            x_SD, _, probs_S, source = self.source.dispatch(x_TD, router_out)
            counts_host = [C_pad] * (ep * L)
            counts_SL = torch.full((ep, L), C_pad, dtype=torch.int64, device=x_TD.device)
            send_splits = [L * C_pad] * ep
        else:
            sent_E = self.source.kept_per_expert(router_out).to(torch.int64)
            counts_SL = all_to_all_counts(sent_E, self.group).view(ep, L)
            sizes = to_host_later(torch.cat([sent_E.view(ep, L).sum(1), counts_SL.reshape(-1)]))
            x_SD, _, probs_S, source = self.source.dispatch(x_TD, router_out)  # queued while the counts travel
            host = sizes()  # the one host sync: split sizes
            send_splits, counts_host = host[:ep], host[ep:]
        recv_splits = [sum(counts_host[s * L:(s + 1) * L]) for s in range(ep)]

        x_QD = all_to_all(x_SD, recv_splits, send_splits, self.group, during_backward=flush)
        probs_Q = all_to_all(probs_S, recv_splits, send_splits, self.group)
        dest_Q, src_P, P, tokens_L, rows_L = expert_major(counts_SL, counts_host, self.align)
        padded = P != x_QD.shape[0]  # padding rows read the appended zero row (prob 0)
        x_PD = dispatch_rows(x_QD, src_P, dest_Q, 1, padded, False)
        probs_P = dispatch_rows(probs_Q[:, None], src_P, dest_Q, 1, padded, False)[:, 0]
        plan = AllToAllPlan(source, send_splits, recv_splits, dest_Q, src_P, P, tokens_L, rows_L)
        return x_PD, rows_L, probs_P, plan

    @property
    def overlaps(self) -> bool:
        """Whether the layer runs `dispatch_compute_combine` (chunks whose transfers overlap compute)."""
        return self.chunks > 1 and self.group.pg is not None

    def dispatch_compute_combine(
        self, x_TD: torch.Tensor, router_out: RouterOutput, experts: ExpertsFn
    ) -> tuple[torch.Tensor, AllToAllPlan]:
        """`combine(experts(*dispatch(...)))` in `self.chunks` chunks whose all-to-alls overlap compute: `(y_TD,
        plan)` (the plan of the last chunk, for its counts).

        Drop-and-pad only: the source lays its rows out chunk-major (`LocalDispatcher(chunks=)`: chunk c holds
        slots [c C_pad/n, (c+1) C_pad/n) of every expert), so each chunk is one static all-to-all. All chunks'
        rows are launched first; chunk c's expert MLP then runs while chunk c+1's rows travel, and chunk c's
        outputs travel back while chunk c+1 computes. The backward mirrors it (`ep_comm.all_to_all_start`):
        only the first and last transfers of n each way stay exposed. The probs (fp32, 1/D of the bytes)
        travel first, waited on at once. Each row meets the same expert weights as unchunked; the expert MLP
        runs once per chunk, so its weight grads are summed in n parts (`experts` reports them once).
        """
        ep, L, n = self.group.size, self.num_local_experts, self.chunks
        T, K = router_out.indices_TK.shape
        C_pad = self.source.rows_per_expert(T, K)
        assert C_pad is not None, "LocalDispatcher(chunks > 1) is built only with pad_to_capacity"
        self._check_same_T(T, x_TD.device)
        x_SD, _, probs_S, source = self.source.dispatch(x_TD, router_out)  # chunk-major, checks n | C_pad
        c = C_pad // n
        splits = [L * c] * ep  # the same each way: every source sends c rows per expert per chunk
        counts_SL = torch.full((ep, L), c, dtype=torch.int64, device=x_TD.device)
        dest_Q, src_P, P, tokens_L, rows_L = expert_major(counts_SL, [c] * (ep * L), self.align)
        padded = P != ep * L * c
        rows_each = round_up(ep * c, self.align)
        # the rows' grads land in one buffer in the backward, the outputs in another forward: no joining copies
        x_grads, y_rows = Landing(n), Landing(n)
        x_chunks = split_chunks(x_SD, n, x_grads)
        probs_Q = [all_to_all(p, splits, splits, self.group) for p in probs_S.split(self.num_experts * c)]  # first:
        # waited on at once, so no wait queues behind the rows' transfers
        sent = [all_to_all_start(x, splits, splits, self.group, Ticket(i, backward=x_grads))
                for i, x in enumerate(x_chunks)]  # fmt: skip
        back = []
        for (placeholder, ticket), p_Q in zip(sent, probs_Q):
            x_QD = all_to_all_wait(placeholder, ticket, splits, splits, self.group)
            x_PD = dispatch_rows(x_QD, src_P, dest_Q, 1, padded, False)
            probs_P = dispatch_rows(p_Q[:, None], src_P, dest_Q, 1, padded, False)[:, 0]
            y_PD = experts(x_PD, rows_L, probs_P, rows_each)
            y_QD = combine_rows(y_PD, src_P, dest_Q, 1, padded, False)
            back.append(all_to_all_start(y_QD, splits, splits, self.group, Ticket(len(back), forward=y_rows)))
        y_SD = join_chunks([all_to_all_wait(placeholder, ticket, splits, splits, self.group)
                            for placeholder, ticket in back], y_rows)  # fmt: skip
        plan = AllToAllPlan(source, splits, splits, dest_Q, src_P, P, tokens_L, rows_L)
        return self.source.combine(y_SD, source), plan

    def _check_same_T(self, T: int, device: torch.device) -> None:
        """Static splits assume every ep rank routes T tokens; a rank with another T would make the all-to-all
        mismatch (garbage or a hang on NCCL). Checked once per T (an eager step sees every shape before a
        CUDA graph captures it, so no collective of this check is ever captured)."""
        if T in self._same_T or self.group.pg is None:
            return
        both = torch.tensor([T, -T], dtype=torch.int64, device=device)
        comm.all_reduce(both, self.group, op=dist.ReduceOp.MAX)
        most, least = both.tolist()
        if most != T or -least != T:
            raise RuntimeError(
                f"ep rank {self.group.rank} routes {T} tokens per micro-batch, others between {-least} and {most}: "
                "drop-and-pad's static all-to-all needs the same micro-batch shape on every ep rank"
            )
        self._same_T.add(T)

    def combine(self, y_PD: torch.Tensor, plan: AllToAllPlan) -> torch.Tensor:
        """Send each received row's output back to its source and sum each token's K outputs: `[T, D]`."""
        y_QD = combine_rows(y_PD, plan.src_P, plan.dest_Q, 1, plan.num_rows != plan.dest_Q.numel(), False)
        y_SD = all_to_all(y_QD, plan.send_splits, plan.recv_splits, self.group)
        return self.source.combine(y_SD, plan.source)
