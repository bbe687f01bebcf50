"""Token dispatch on one device: permute routings by expert, pad or drop, and combine the results back.

Shape suffixes: T tokens, D hidden, E experts, K experts per token, N = T*K routings (token-major: routing
n is token n // K, choice n % K), R routings after sorting by expert (dropped ones last), P rows of the
expert input (kept routings grouped by expert, each expert's segment padded).

- Sort: a stable sort by expert id, so within an expert rows keep token order (deterministic, and the same
  rows in the same order whatever the parameter layout).
- Capacity (`capacity_factor`): each expert keeps at most C = ceil(factor * T*K / E) routings, at most T (all an
  expert can get: `expert_capacity`), the ones with the highest routing prob (ties: the earlier token),
  Megatron's default "probs" drop policy; dropped routings contribute nothing to their token's output.
  `pad_expert_input_to_capacity` then pads every expert to exactly C rows (rounded up to `align`): P = E * C
  is static, no host sync.
- Alignment (`align`): each expert's segment is padded with zero rows of prob 0 to a multiple of `align`
  (quantized grouped GEMMs need 16/32-row groups). A prob-0 row's output is 0 and its grads are 0, so
  padding changes neither outputs nor weight grads. Dropless, the padded total is data-dependent but
  bounded: at most `align - 1` rows per expert. P is that bound (rounded down to a multiple of `align`) and
  the slack goes to the last expert as more padding, so the shape is static (no host sync; what a CUDA
  graph needs) at a cost of at most E * (align - 1) zero rows, one expert's worth of extra tiles.
- Combine: each kept routing's output row (already scaled by its prob inside the expert MLP) goes back to
  its `[T, K]` slot, and the K slots of a token are summed in a fixed order: no atomics, so the result is
  deterministic on every device.
- Rows move by gathers in both directions, forward and backward (`permute.py`): one gather builds x_PD,
  padding included, and its backward sums each token's K row grads; no scatter-add anywhere.

Host syncs: only to size P when routings are dropped (a capacity without pad-to-capacity).
`LocalDispatcher` is the one-device dispatcher; an expert-parallel all-to-all dispatcher keeps its interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from moectl.core.arith import round_up
from moectl.core.errors import ConfigError
from moectl.core.facts import expert_capacity
from trainer.moe.delayed_wgrad import flush_point
from trainer.moe.permute import combine_rows, dispatch_rows
from trainer.moe.expert_order import sort_by_expert
from trainer.moe.router import RouterOutput
from trainer.sort_keys import compact_ids


@dataclass
class DispatchPlan:
    """How routings were laid out, so `combine` can put the expert outputs back."""

    num_tokens: int  # T
    topk: int  # K
    order_R: torch.Tensor  # routing index (into T*K) of each sorted routing; kept ones first, by expert
    src_P: torch.Tensor  # routing index of each row of x_PD, N for padding rows
    row_N: torch.Tensor  # row of x_PD of each routing, P for dropped ones
    padded: bool  # x_PD has padding rows (alignment or pad-to-capacity)
    dropped: bool  # routings may have been dropped (a capacity): row_N holds P for them
    num_rows: int  # P
    tokens_per_expert_E: torch.Tensor  # kept routings per expert, before padding (int64)
    rows_per_expert_E: torch.Tensor  # rows per expert in x_PD, padding included (int64)
    num_dropped: torch.Tensor  # routings dropped by the capacity (int64 scalar)


class LocalDispatcher:
    """Permute, pad or drop, and combine, for experts that all live on this device."""

    def __init__(
        self,
        num_experts: int,
        *,
        align: int = 1,
        capacity_factor: Optional[float] = None,
        pad_to_capacity: bool = False,
        chunks: int = 1,
    ) -> None:
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        if chunks < 1 or (chunks > 1 and not pad_to_capacity):
            raise ValueError(f"chunks={chunks}: a chunked layout needs chunks >= 1 and pad_to_capacity")
        if pad_to_capacity and capacity_factor is None:
            raise ConfigError(
                "moe.pad_expert_input_to_capacity", True, "needs a capacity to pad to",
                "set moe.capacity_factor (e.g. 1.25) or turn pad_expert_input_to_capacity off",
            )  # fmt: skip
        if capacity_factor is not None and capacity_factor <= 0:
            raise ConfigError("moe.capacity_factor", capacity_factor, "must be positive", "use e.g. 1.0 or 1.25")
        self.num_experts = num_experts
        self.align = align
        self.capacity_factor = capacity_factor
        self.pad_to_capacity = pad_to_capacity
        self.chunks = chunks  # > 1: x_PD chunk-major, [chunk][expert][C_pad / chunks rows] (the ep overlap)

    def rows_per_expert(self, T: int, K: int) -> Optional[int]:
        """Every expert's input rows when they are fixed by the config (padded to capacity), else None."""
        if not self.pad_to_capacity:
            return None
        assert self.capacity_factor is not None
        return round_up(expert_capacity(self.capacity_factor, T, K, self.num_experts), self.align)

    def kept_per_expert(self, router_out: RouterOutput) -> torch.Tensor:
        """Routings each expert keeps after the capacity drop (`[E]`, as `dispatch` sizes them), from the
        router's counts alone: known before the permutation is queued."""
        counts_E = router_out.tokens_per_expert_E
        if self.capacity_factor is None:
            return counts_E
        T, K = router_out.indices_TK.shape
        return torch.clamp(counts_E, max=expert_capacity(self.capacity_factor, T, K, self.num_experts))

    def dropless_rows(self, T: int, K: int) -> int:
        """P for dropless experts: T*K routings plus at most `align - 1` padding rows per expert, rounded down
        to a multiple of `align` (the padded total is one, so it never exceeds this)."""
        return (T * K + self.num_experts * (self.align - 1)) // self.align * self.align

    def dispatch(
        self, x_TD: torch.Tensor, router_out: RouterOutput, flush: Optional[Callable[[], None]] = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchPlan]:
        """Group token rows by expert: `(x_PD, rows_per_expert_E, probs_P, plan)`.

        `rows_per_expert_E` (padding included) is what the expert MLP groups by; `probs_P` is 0 on padding.
        Grads flow back to `x_TD` and to the router's probs. `flush` (delayed expert wgrad) runs in the
        backward as soon as x_PD's grad is known: one device has no collective to hide it behind.
        """
        T, K = router_out.indices_TK.shape
        E, N = self.num_experts, T * K
        experts_N = router_out.indices_TK.reshape(N)
        probs_N = router_out.probs_TK.reshape(N)
        counts_E = router_out.tokens_per_expert_E
        dev = experts_N.device

        key_N = experts_N
        if self.capacity_factor is not None:
            C = expert_capacity(self.capacity_factor, T, K, E)
            # rank each routing within its expert by prob (desc), ties by routing index; keep rank < C
            by_prob_N = torch.argsort(probs_N.detach(), descending=True, stable=True)
            ranked_N = by_prob_N[torch.argsort(compact_ids(experts_N[by_prob_N], E), stable=True)]
            starts_E = torch.cumsum(counts_E, 0) - counts_E
            rank_N = torch.arange(N, device=dev) - starts_E[experts_N[ranked_N]]
            keep_N = torch.empty(N, dtype=torch.bool, device=dev)
            keep_N[ranked_N] = rank_N < C
            key_N = torch.where(keep_N, experts_N, E)  # dropped routings sort after every expert
            counts_E = self.kept_per_expert(router_out)
        # inverse_N: each routing's place in the sorted order (dropped routings sort last, as key E)
        order_R, inverse_N = sort_by_expert(key_N, E if self.capacity_factor is None else E + 1)

        if self.pad_to_capacity:
            C_pad = self.rows_per_expert(T, K)
            assert C_pad is not None
            rows_E = torch.full((E,), C_pad, dtype=torch.int64, device=dev)
            P = C_pad * E  # static: no host sync
            if C_pad % self.chunks:
                raise ConfigError(
                    "moe.ep_overlap_chunks", self.chunks,
                    f"must divide every expert's padded capacity ({C_pad} rows for {T} tokens per micro-batch)",
                    "choose a divisor of it (e.g. 2 or 4), or 1",
                )  # fmt: skip
        elif self.align > 1 and self.capacity_factor is None:
            P = self.dropless_rows(T, K)
            rows_E = round_up(counts_E, self.align)
            rows_E[-1] += P - rows_E.sum()  # the slack: padding of the last expert, still a multiple of align
        elif self.align > 1:
            rows_E = round_up(counts_E, self.align)
            P = int(rows_E.sum())  # host sync: P is data-dependent
        else:
            rows_E = counts_E
            P = N if self.capacity_factor is None else int(counts_E.sum())

        if self.capacity_factor is None and self.align == 1:  # x_PD is the sorted routings themselves
            src_P, row_N = order_R, inverse_N
        else:
            arange_N = torch.arange(N, device=dev)
            key_R = key_N[order_R]
            e_R = key_R.clamp(max=E - 1)
            kept_start_E = torch.cumsum(counts_E, 0) - counts_E
            row_start_E = torch.cumsum(rows_E, 0) - rows_E
            slot_R = arange_N - kept_start_E[e_R]  # the routing's place among its expert's kept ones
            if self.chunks > 1:  # slot s of expert e in chunk s // c, so each chunk is one contiguous block
                c = P // (E * self.chunks)
                at_R = (slot_R // c) * (E * c) + e_R * c + slot_R % c
            else:
                at_R = row_start_E[e_R] + slot_R
            dest_R = torch.where(key_R < E, at_R, P)  # P: dropped
            # every dropped routing writes the trash slot P, which is sliced off: which one wins is moot
            src_P = torch.full((P + 1,), N, dtype=torch.int64, device=dev).index_put_((dest_R,), order_R)[:P]
            row_N = dest_R[inverse_N]  # routing n is sorted routing inverse_N[n]
        padded, dropped = self.pad_to_capacity or self.align > 1, self.capacity_factor is not None
        x_PD = flush_point(dispatch_rows(x_TD, src_P, row_N, K, padded, dropped), flush)
        probs_P = dispatch_rows(probs_N[:, None], src_P, row_N, 1, padded, dropped)[:, 0]  # routings: tokens of K=1

        plan = DispatchPlan(
            num_tokens=T, topk=K, order_R=order_R, src_P=src_P, row_N=row_N, padded=padded, dropped=dropped,
            num_rows=P,
            tokens_per_expert_E=counts_E, rows_per_expert_E=rows_E,
            num_dropped=(
                router_out.tokens_per_expert_E.sum() - counts_E.sum() if dropped else counts_E.new_zeros(())
            ),
        )  # fmt: skip
        return x_PD, rows_E, probs_P, plan

    def combine(self, y_PD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Sum each token's K expert outputs back into `[T, D]` (probs were applied in the expert MLP)."""
        return combine_rows(y_PD, plan.src_P, plan.row_N, plan.topk, plan.padded, plan.dropped)
