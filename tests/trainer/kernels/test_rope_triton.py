"""The Triton kernels of `rope_qkv` (trainer/kernels/rope_triton.py), on GPUs (marked `gpu`).

Forward and backward bit for bit the torch definition on the same device (the kernels skip fused multiply-adds
so each product and sum rounds as the eager ops do), bf16 and fp32, with grads strided as cuDNN's attention
returns them, a sequence shorter than the cos/sin table and a head dim that is no power of two (96, the lanes past
C/2 masked); and the attention with the fused op equal to the unfused attention on CUDA (forward and the
projection's grad).
"""

from __future__ import annotations

import pytest
import torch

from trainer.attention import SelfAttention
from trainer.kernels import has_triton
from trainer.rope import rope_cache, rope_qkv_backward_reference, rope_qkv_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device tool)"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "groups", "C"), [(16, 4, 128), (8, 8, 64), (12, 1, 128), (6, 2, 96)])
def test_kernels_are_the_torch_definition_bitwise(dtype: torch.dtype, heads: int, groups: int, C: int) -> None:
    if not has_triton():
        pytest.skip("needs Triton")
    from trainer.kernels.rope_triton import rope_qkv_backward, rope_qkv_forward

    g = torch.Generator().manual_seed(heads)
    B, S = 2, 300
    cache = rope_cache(512, C, 10000.0).cuda()
    qkv = torch.randn(B, S, (heads + 2 * groups) * C, generator=g).to(dtype).cuda()
    for got, want in zip(rope_qkv_forward(qkv, cache, heads, groups), rope_qkv_reference(qkv, cache, heads, groups)):
        assert got.is_contiguous() and torch.equal(got, want)
    dq = torch.randn(B, heads, S, C, generator=g).to(dtype).cuda().transpose(1, 2)  # cuDNN's [B, N, S, C] memory
    dk = torch.randn(B, S, groups, C, generator=g).to(dtype).cuda()
    dv = torch.randn(B, groups, S, C, generator=g).to(dtype).cuda().transpose(1, 2)
    got = rope_qkv_backward(dq, dk, dv, cache, heads, groups)
    assert torch.equal(got, rope_qkv_backward_reference(dq, dk, dv, cache, heads, groups))


def test_attention_with_the_kernels_is_the_unfused_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    if not has_triton():
        pytest.skip("needs Triton")
    torch.manual_seed(0)
    attn = SelfAttention(2048, 16, 4, dtype=torch.bfloat16).cuda()
    cache = rope_cache(1024, 128, 10000.0).cuda()
    qkv = torch.randn(2, 1024, (16 + 2 * 4) * 128, device="cuda", dtype=torch.bfloat16)
    res = {}
    for fused in (True, False):
        x = qkv.clone().requires_grad_()
        out = attn.attend(x, cache, fused)
        out.float().square().sum().backward()
        res[fused] = (out.detach(), x.grad)
    assert torch.equal(res[True][0], res[False][0]) and torch.equal(res[True][1], res[False][1])
