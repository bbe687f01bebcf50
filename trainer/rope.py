"""Rotate-half RoPE (GPT-NeoX / Llama / Megatron convention: pairs (i, i + C/2)) and the split of a fused qkv
projection into rotated queries and keys and the values, as one op.

Shapes: B batch, S sequence, N query heads, G query groups (kv heads), C head dim; the qkv projection's `R =
(N + 2G) * C` columns are grouped as `trainer.attention` says (per group: its `N/G` query heads, its key head,
its value head).

`rope_qkv` is a custom op: on CUDA with Triton (`kernels/rope_triton.py`) one kernel reads the projection and
writes q and k rotated and v contiguous, and one kernel turns the three grads back into the projection's grad.
Inside the compiled attention region (`trainer/compile.py`) inductor made two rotation kernels forward (q and
k) and three backward, the last one assembling the projection's grad from three pieces: ~150 us per layer and
micro-batch at the reference shape on an H100 against the ~60 us the two passes need at memory speed. The op's
math is `apply_rope`'s, in fp32 with one rounding; elsewhere it runs as torch ops (`rope_qkv_reference`).
`MOECTL_TRITON_ROPE=0` keeps the attention's own split and `apply_rope`.
"""

from __future__ import annotations

import torch

from trainer.kernels import triton_runs


def rope_cache(seq_length: int, head_dim: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """cos/sin tables `[S, C/2, 2]` in fp32 for rotate-half RoPE."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32, device=device), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x_BSNC: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of `[B, S, heads, C]`, computed in fp32 and rounded once to x's dtype.

    On `[B, S, heads, C]`, the layout the projection writes: a compiled region then writes the rotated
    heads contiguous in that layout, the attention's output follows its query's layout (cuDNN's does), and
    merging the heads after it is a view instead of a transposing copy, forward and backward.
    """
    s = x_BSNC.shape[1]
    cos, sin = cache[:s, None, :, 0], cache[:s, None, :, 1]  # [S, 1, C/2]
    x1, x2 = x_BSNC.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x_BSNC.dtype)


def unrotate(d_BSNC: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """The grad of `apply_rope`'s input from its output's grad (the inverse rotation), in fp32, rounded once:
    `(d1 cos + d2 sin, d2 cos - d1 sin)`, the sums autograd forms through `apply_rope`."""
    s = d_BSNC.shape[1]
    cos, sin = cache[:s, None, :, 0], cache[:s, None, :, 1]
    d1, d2 = d_BSNC.float().chunk(2, dim=-1)
    return torch.cat([d1 * cos + d2 * sin, d2 * cos - d1 * sin], dim=-1).to(d_BSNC.dtype)


def fast_rope(device: torch.device) -> bool:
    """Whether the attention takes `rope_qkv` on `device` (its Triton kernels)."""
    return triton_runs(device, "MOECTL_TRITON_ROPE")


def split_qkv(qkv_BSR: torch.Tensor, num_heads: int, num_groups: int) -> tuple[torch.Tensor, ...]:
    """Views `(q [B, S, G, N/G, C], k [B, S, G, C], v [B, S, G, C])` of the projection's output."""
    b, s, r = qkv_BSR.shape
    per_group = num_heads // num_groups
    qkv = qkv_BSR.view(b, s, num_groups, per_group + 2, r // (num_groups * (per_group + 2)))
    return qkv[:, :, :, :per_group], qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]


def rope_qkv_reference(qkv_BSR: torch.Tensor, cache: torch.Tensor, num_heads: int,
                       num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`rope_qkv` in torch: q `[B, S, N, C]` and k `[B, S, G, C]` rotated, v `[B, S, G, C]`, all contiguous."""
    q, k, v = split_qkv(qkv_BSR, num_heads, num_groups)
    b, s = qkv_BSR.shape[:2]
    q_BSNC = apply_rope(q.reshape(b, s, num_heads, -1), cache)
    # fresh tensors: a custom op's outputs must not alias its input (`contiguous` of a contiguous v would)
    return q_BSNC, apply_rope(k, cache).contiguous(), v.clone(memory_format=torch.contiguous_format)


def rope_qkv_backward_reference(dq_BSNC: torch.Tensor, dk_BSGC: torch.Tensor, dv_BSGC: torch.Tensor,
                                cache: torch.Tensor, num_heads: int, num_groups: int) -> torch.Tensor:  # fmt: skip
    """The projection's grad `[B, S, R]` from the grads of `rope_qkv`'s three outputs, in torch."""
    b, s, _, c = dq_BSNC.shape
    per_group = num_heads // num_groups
    dq = unrotate(dq_BSNC, cache).view(b, s, num_groups, per_group, c)
    dk = unrotate(dk_BSGC, cache)[:, :, :, None]
    return torch.cat([dq, dk, dv_BSGC[:, :, :, None]], dim=3).reshape(b, s, -1)


@torch.library.custom_op("moectl::rope_qkv", mutates_args=())
def rope_qkv(qkv_BSR: torch.Tensor, cache: torch.Tensor, num_heads: int,
             num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Split the fused qkv projection `[B, S, R]` into q `[B, S, N, C]` and k `[B, S, G, C]`, rotated by the
    cos/sin `cache` (`rope_cache`), and v `[B, S, G, C]`, each contiguous."""
    if qkv_BSR.is_cuda and fast_rope(qkv_BSR.device):
        from trainer.kernels.rope_triton import rope_qkv_forward

        return rope_qkv_forward(qkv_BSR, cache, num_heads, num_groups)
    return rope_qkv_reference(qkv_BSR, cache, num_heads, num_groups)


@rope_qkv.register_fake
def _(qkv_BSR: torch.Tensor, cache: torch.Tensor, num_heads: int,
      num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    b, s, r = qkv_BSR.shape
    c = r // (num_heads + 2 * num_groups)
    kv = qkv_BSR.new_empty((b, s, num_groups, c))
    return qkv_BSR.new_empty((b, s, num_heads, c)), kv, torch.empty_like(kv)


@torch.library.custom_op("moectl::rope_qkv_backward", mutates_args=())
def rope_qkv_backward(dq_BSNC: torch.Tensor, dk_BSGC: torch.Tensor, dv_BSGC: torch.Tensor, cache: torch.Tensor,
                      num_heads: int, num_groups: int) -> torch.Tensor:  # fmt: skip
    """The grad of `rope_qkv`'s input `[B, S, R]` from its outputs' grads."""
    if dq_BSNC.is_cuda and fast_rope(dq_BSNC.device):
        from trainer.kernels.rope_triton import rope_qkv_backward as kernel

        return kernel(dq_BSNC, dk_BSGC, dv_BSGC, cache, num_heads, num_groups)
    return rope_qkv_backward_reference(dq_BSNC, dk_BSGC, dv_BSGC, cache, num_heads, num_groups)


@rope_qkv_backward.register_fake
def _(dq_BSNC: torch.Tensor, dk_BSGC: torch.Tensor, dv_BSGC: torch.Tensor, cache: torch.Tensor, num_heads: int,
      num_groups: int) -> torch.Tensor:  # fmt: skip
    b, s, _, c = dq_BSNC.shape
    return dq_BSNC.new_empty((b, s, (num_heads + 2 * num_groups) * c))


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    _, cache, num_heads, num_groups = inputs
    ctx.save_for_backward(cache)
    ctx.heads = (num_heads, num_groups)


def _backward(ctx: torch.autograd.function.FunctionCtx, dq: torch.Tensor, dk: torch.Tensor,
              dv: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # fmt: skip
    # an output nothing used arrives as zeros (autograd materialises them), so its columns' grad is zero
    (cache,) = ctx.saved_tensors
    return rope_qkv_backward(dq, dk, dv, cache, *ctx.heads), None, None, None


rope_qkv.register_autograd(_backward, setup_context=_setup)
