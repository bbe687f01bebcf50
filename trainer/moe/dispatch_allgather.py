"""Expert-parallel token dispatch by all-gather: every ep rank sees every token, keeps its experts' routings.

Shape suffixes: T tokens per rank, A = ep*T tokens of the whole ep group, D hidden, K experts per token,
N = A*K routings, L local experts, R routings to local experts (sorted by local expert), P rows of the
local experts' input (each segment padded to `align`).

1. all-gather the tokens `[A, D]`, their probs `[A, K]` and expert ids over the ep group (rank-major, so
   the A tokens are in global-batch order);
2. keep the routings whose expert is local, sort them by local expert (stable: token order within an
   expert, as on one device), pad each expert's segment to `align` with zero rows of prob 0;
3. combine: each kept routing's output goes to its `[A, K]` slot, the K slots are summed in a fixed order
   (routings to other ranks' experts are zero here), and a reduce-scatter (SUM) over the ep group gives
   every rank the full outputs of its own T tokens.

Backward: the all-gathers' backward is a reduce-scatter (SUM) and the reduce-scatter's an all-gather, both
unscaled (`ep_comm`), so an expert's weight grad sums the contributions of every rank's tokens, as with
the all-to-all dispatcher. Every ep rank must route the same number of tokens (equal micro-batches).
It moves ep times the tokens of the all-to-all dispatcher and needs no split sizes; capacity drops are
not supported here (use `token_dispatcher: alltoall`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

from moectl.core.arith import round_up
from moectl.core.errors import ConfigError
from trainer.moe.dispatch_alltoall import check_divisible
from trainer.moe.ep_comm import all_gather_rows, all_gather_rows_nograd, reduce_scatter_rows
from trainer.moe.router import RouterOutput
from trainer.sort_keys import compact_ids

if TYPE_CHECKING:
    from trainer.parallel.groups import Group


@dataclass
class AllGatherPlan:
    """What `combine` needs to put local experts' outputs back and reduce-scatter them."""

    num_tokens: int  # A
    topk: int  # K
    sel_R: torch.Tensor  # routing index (into A*K) of each kept routing, sorted by local expert
    dest_R: Optional[torch.Tensor]  # row of x_PD for each kept routing; None = identity (no padding)
    num_rows: int  # P
    tokens_per_expert_E: torch.Tensor  # kept routings per local expert (int64, [L])
    rows_per_expert_E: torch.Tensor  # rows per local expert in x_PD, padding included (int64, [L])
    num_dropped: torch.Tensor  # always 0: no capacity with this dispatcher


class AllGatherDispatcher:
    """`LocalDispatcher`'s interface over experts sharded on the ep group, by all-gather and reduce-scatter."""

    def __init__(
        self,
        num_experts: int,
        ep_group: "Group",
        *,
        align: int = 1,
        capacity_factor: Optional[float] = None,
        pad_to_capacity: bool = False,
    ) -> None:
        check_divisible(num_experts, ep_group.size)
        if capacity_factor is not None or pad_to_capacity:
            raise ConfigError(
                "moe.token_dispatcher", "allgather",
                "drops no tokens: capacity_factor and pad_expert_input_to_capacity need the alltoall dispatcher "
                "under expert parallelism",
                "set moe.token_dispatcher=alltoall, or moe.capacity_factor=null",
            )  # fmt: skip
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        self.num_experts = num_experts
        self.group = ep_group
        self.num_local_experts = num_experts // ep_group.size
        self.first_expert = ep_group.rank * self.num_local_experts
        self.align = align

    def rows_per_expert(self, T: int, K: int) -> Optional[int]:
        """None: each local expert's rows depend on what the other ranks send."""
        return None

    def dispatch(
        self, x_TD: torch.Tensor, router_out: RouterOutput, flush: Optional[Callable[[], None]] = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AllGatherPlan]:
        """`(x_PD, rows_per_expert_E, probs_P, plan)` for this rank's local experts (tokens of every ep rank).

        `flush` (delayed expert wgrad) runs in the backward while the tokens' grads are reduce-scattered."""
        L, align = self.num_local_experts, self.align
        x_AD = all_gather_rows(x_TD, self.group, during_backward=flush)
        probs_AK = all_gather_rows(router_out.probs_TK, self.group)
        ids_AK = all_gather_rows_nograd(router_out.indices_TK, self.group)
        A, K = ids_AK.shape
        N = A * K
        dev = ids_AK.device
        local_N = ids_AK.reshape(N) - self.first_expert
        key_N = torch.where((local_N >= 0) & (local_N < L), local_N, L)  # other ranks' experts sort last
        order_N = torch.argsort(compact_ids(key_N, L), stable=True)
        counts_L = torch.bincount(key_N, minlength=L + 1)[:L]
        rows_L = round_up(counts_L, align)
        R, P = torch.stack([counts_L.sum(), rows_L.sum()]).tolist()  # host sync: sizes
        sel_R = order_N[:R]
        x_RD = x_AD[sel_R // K]
        probs_R = probs_AK.reshape(N)[sel_R]
        if align == 1:
            dest_R = None
            x_PD, probs_P = x_RD, probs_R
        else:
            e_R = key_N[sel_R]
            kept_start = torch.cumsum(counts_L, 0) - counts_L
            row_start = torch.cumsum(rows_L, 0) - rows_L
            dest_R = row_start[e_R] + torch.arange(R, device=dev) - kept_start[e_R]
            x_PD = x_RD.new_zeros(P, x_RD.shape[1]).index_put((dest_R,), x_RD)
            probs_P = probs_R.new_zeros(P).index_put((dest_R,), probs_R)
        plan = AllGatherPlan(A, K, sel_R, dest_R, P, counts_L, rows_L, torch.zeros((), dtype=torch.int64, device=dev))
        return x_PD, rows_L, probs_P, plan

    def combine(self, y_PD: torch.Tensor, plan: AllGatherPlan) -> torch.Tensor:
        """Sum each token's outputs from the local experts, then reduce-scatter over ep: `[T, D]`."""
        A, K, D = plan.num_tokens, plan.topk, y_PD.shape[1]
        y_RD = y_PD if plan.dest_R is None else y_PD[plan.dest_R]
        y_ND = y_RD.new_zeros(A * K, D).index_put((plan.sel_R,), y_RD)  # unique indices: no atomics
        return reduce_scatter_rows(y_ND.view(A, K, D).sum(dim=1), self.group)
