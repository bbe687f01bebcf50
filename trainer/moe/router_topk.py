"""The router's top-k ids on CUDA as an op `torch.compile` calls as it is (trainer/kernels/topk_triton.py).

Inductor lowers `torch.topk` to ATen's two kernels; as a custom op the Triton kernel runs inside the compiled
router's graph (and its CUDA graph) instead. `MOECTL_TRITON_TOPK=0` keeps `torch.topk`.
"""

from __future__ import annotations

import torch

from trainer.kernels import triton_runs


@torch.library.custom_op("moectl::router_topk_ids", mutates_args=())
def router_topk_ids(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """`[T, k]` int64 ids of each row's k largest scores, largest first (ties: the lower id); CUDA only."""
    from trainer.kernels.topk_triton import topk_ids

    return topk_ids(scores_TE, k)


@router_topk_ids.register_fake
def _(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    return scores_TE.new_empty((scores_TE.shape[0], k), dtype=torch.int64)


def fast_topk(device: torch.device) -> bool:
    """Whether the router takes the Triton top-k on `device`."""
    return triton_runs(device, "MOECTL_TRITON_TOPK")


def topk(scores_TE: torch.Tensor, k: int, fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values, ids)` of each row's k largest scores, as `torch.topk(scores, k, dim=-1)`. `fast`: the ids from
    the Triton kernel and the values gathered from the scores (grads flow through the gather): torch's result
    where no two of a row's scores tie (of tied scores the kernel takes the lower id first, torch's order is
    unspecified)."""
    if fast:
        ids_TK = router_topk_ids(scores_TE.detach().float(), k)
        return scores_TE.gather(-1, ids_TK), ids_TK
    return torch.topk(scores_TE, k, dim=-1)
