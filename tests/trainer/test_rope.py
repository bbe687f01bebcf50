"""RoPE and the fused split of the qkv projection (trainer/rope.py).

CPU: `rope_qkv` (its torch definition off CUDA) gives the attention's own split and `apply_rope` bit for bit,
forward and backward (bf16 and fp32, GQA and MHA), also traced by `torch.compile` (aot_eager: the fake and the
autograd registrations), and an output nobody uses gets a zero grad; `SelfAttention.attend` with and without
the fused op agree bitwise. The Triton kernels are tested on GPUs (tests/trainer/kernels/test_rope_triton.py).
"""

from __future__ import annotations

import pytest
import torch

from trainer.attention import SelfAttention
from trainer.rope import apply_rope, rope_cache, rope_qkv, split_qkv


def _unfused(qkv_BSR: torch.Tensor, cache: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, ...]:
    b, s, _ = qkv_BSR.shape
    q, k, v = split_qkv(qkv_BSR, heads, groups)
    return apply_rope(q.reshape(b, s, heads, -1), cache), apply_rope(k, cache), v


def _grads(fn, qkv: torch.Tensor, weights: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    x = qkv.detach().clone().requires_grad_()
    outs = fn(x)
    sum((o.float() * w).sum() for o, w in zip(outs, weights)).backward()
    return [o.detach() for o in outs], x.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "groups"), [(8, 2), (4, 4), (6, 1)])
def test_rope_qkv_is_the_split_and_apply_rope(dtype: torch.dtype, heads: int, groups: int) -> None:
    """Outputs and the projection's grad equal the unfused path's bit for bit (the backward is the inverse
    rotation autograd forms, `(d1 cos + d2 sin, d2 cos - d1 sin)`); q, k, v come contiguous."""
    g = torch.Generator().manual_seed(heads)
    C, S = 16, 12
    cache = rope_cache(32, C, 10000.0)  # longer than S: the op reads its first S rows
    qkv = torch.randn(2, S, (heads + 2 * groups) * C, generator=g).to(dtype)
    weights = [torch.randn(2, S, n, C, generator=g) for n in (heads, groups, groups)]
    fused, d_fused = _grads(lambda x: rope_qkv(x, cache, heads, groups), qkv, weights)
    plain, d_plain = _grads(lambda x: _unfused(x, cache, heads, groups), qkv, weights)
    for a, b in zip(fused, plain):
        assert a.is_contiguous() and a.dtype == dtype
        assert torch.equal(a, b)
    assert torch.equal(d_fused, d_plain)
    assert not torch.equal(fused[0], split_qkv(qkv, heads, groups)[0].reshape(2, S, heads, C))  # it rotates


def test_rope_qkv_traces_under_compile() -> None:
    """The fake and autograd registrations: a compiled call (aot_eager) gives the eager op's outputs and grad."""
    g = torch.Generator().manual_seed(0)
    cache = rope_cache(8, 8, 10000.0)
    qkv = torch.randn(2, 8, (4 + 2 * 2) * 8, generator=g).bfloat16()
    weights = [torch.randn(2, 8, n, 8, generator=g) for n in (4, 2, 2)]
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: rope_qkv(x, cache, 4, 2), backend="aot_eager", fullgraph=True)
    outs_c, d_c = _grads(compiled, qkv, weights)
    outs_e, d_e = _grads(lambda x: rope_qkv(x, cache, 4, 2), qkv, weights)
    assert all(torch.equal(a, b) for a, b in zip(outs_c, outs_e)) and torch.equal(d_c, d_e)


def test_an_unused_output_gets_a_zero_grad() -> None:
    """Only q used: the key and value columns of the projection's grad are zero, q's are the rotation's."""
    cache = rope_cache(4, 8, 10000.0)
    qkv = torch.randn(1, 4, (2 + 2) * 8, requires_grad=True)
    q, _, _ = rope_qkv(qkv, cache, 2, 1)
    q.sum().backward()
    grad = qkv.grad.view(1, 4, 1, 4, 8)
    assert torch.count_nonzero(grad[:, :, :, 2:]) == 0 and torch.count_nonzero(grad[:, :, :, :2]) > 0


def test_attend_with_the_fused_op_is_the_unfused_attention() -> None:
    """`SelfAttention.attend(..., fused_rope=True)` (the path CUDA takes) equals the unfused one bitwise."""
    torch.manual_seed(0)
    attn = SelfAttention(64, 4, 2, dtype=torch.float32)
    cache = rope_cache(16, 16, 10000.0)
    qkv = torch.randn(2, 16, (4 + 2 * 2) * 16)
    res = {}
    for fused in (True, False):
        x = qkv.clone().requires_grad_()
        out = attn.attend(x, cache, fused)
        out.square().sum().backward()
        res[fused] = (out.detach(), x.grad)
    assert torch.equal(res[True][0], res[False][0]) and torch.equal(res[True][1], res[False][1])


def test_one_token_one_group_returns_fresh_tensors() -> None:
    """B = S = 1 with one kv group: v's view is already contiguous, and a custom op may not return it."""
    cache = rope_cache(4, 8, 10000.0)
    qkv = torch.randn(1, 1, (2 + 2) * 8)
    q, k, v = rope_qkv(qkv, cache, 2, 1)
    assert v.data_ptr() != qkv.data_ptr() and torch.equal(v, qkv.view(1, 1, 1, 4, 8)[:, :, :, 3])
