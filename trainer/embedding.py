"""Token embedding (Megatron's `embedding.word_embeddings`), with its weight grad fused into `main_grad`.

Under `gradient_accumulation_fusion` the backward adds the weight grad straight into the fp32
`weight.main_grad` and reports it (`trainer/main_grad.py`), as the fused linears do: on CUDA with Triton only
the rows of the micro-batch's tokens are summed (in fp32, in a fixed order) and added
(`kernels/embedding_grad_triton.py`); elsewhere the dense grad autograd would have made is added, the
same bits the grad buffer's hook would add. A tied embedding (the output head reads the same weight through
autograd) keeps the autograd path: the two grads must meet in `.grad` and report once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.kernels import triton_runs
from trainer.main_grad import grad_ready, require_main_grad, settle_stale
from trainer.sort_keys import compact_ids


def accumulate_embedding_grad(param: nn.Parameter, ids_N: torch.Tensor, g_ND: torch.Tensor) -> None:
    """`param.main_grad[ids[n]] += g[n]` for a `[V, D]` embedding weight, then report the grad ready."""
    main_grad = param.main_grad  # type: ignore[attr-defined]
    settle_stale(param)
    if (triton_runs(main_grad.device, "MOECTL_TRITON_EMBEDDING_GRAD") and main_grad.dtype == torch.float32
            and main_grad.is_contiguous()):  # fmt: skip
        from trainer.kernels.embedding_grad_triton import add_embedding_grad

        sorted_ids, order = torch.sort(compact_ids(ids_N, main_grad.shape[0] - 1), stable=True)
        add_embedding_grad(main_grad, sorted_ids, order, g_ND)
    else:
        dense = torch.ops.aten.embedding_dense_backward(g_ND, ids_N, main_grad.shape[0], -1, False)
        main_grad.add_(dense)  # the dense grad in the weight's dtype, added as the buffer's hook adds it
    grad_ready(param)


class _FusedWgradEmbedding(torch.autograd.Function):
    """y = W[ids]; backward: the weight grad into `W.main_grad` (no autograd grad); ids get none."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: nn.Parameter) -> torch.Tensor:
        require_main_grad(weight)
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, None]:
        (ids,) = ctx.saved_tensors
        accumulate_embedding_grad(ctx.weight, ids.reshape(-1), g.reshape(-1, g.shape[-1]))
        return None, None


class Embedding(nn.Module):
    """Token embedding `[V, D]` (state-dict key `word_embeddings.weight`)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 gradient_accumulation_fusion: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size, dtype=dtype)
        self.gradient_accumulation_fusion = gradient_accumulation_fusion

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        weight = self.word_embeddings.weight
        if self.gradient_accumulation_fusion and torch.is_grad_enabled() and weight.requires_grad:
            return _FusedWgradEmbedding.apply(tokens_BS, weight)
        return self.word_embeddings(tokens_BS)
