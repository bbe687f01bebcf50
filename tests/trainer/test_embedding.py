"""The token embedding's weight grad fused into `main_grad` (trainer/embedding.py).

CPU: the fused backward adds the dense grad autograd would make, bit for bit what the grad buffer's hook
adds, reports the param once per backward and leaves `.grad` unset; a tied embedding keeps autograd. GPU
(marked `gpu`): the Triton path (only seen rows, fp32 sums) against fp64: no further off than the dense
bf16 path, and the same bits run to run, with a token repeated past one block of rows.
"""

from __future__ import annotations

import pytest
import torch

from moectl.core.config.schema import ModelConfig, MoEConfig
from trainer.embedding import Embedding
from trainer.main_grad import READY_HOOK, attach_main_grads
from trainer.model import GPTMoE


def _ids(B: int, S: int, V: int, seed: int, device: str = "cpu") -> torch.Tensor:
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))
    ids[0, : S // 2] = 3  # one token many times: a run longer than the kernel's 16-row block
    return ids.to(device)


def _run(emb: Embedding, ids: list[torch.Tensor], gs: list[torch.Tensor]) -> None:
    for i, g in zip(ids, gs):
        emb(i).backward(g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_grad_is_what_the_buffer_hook_adds(dtype: torch.dtype) -> None:
    V, D = 50, 24
    ids = [_ids(2, 40, V, s) for s in range(2)]
    gs = [torch.randn(2, 40, D, generator=torch.Generator().manual_seed(9 + s)).to(dtype) for s in range(2)]
    plain, fused = Embedding(V, D, dtype), Embedding(V, D, dtype, gradient_accumulation_fusion=True)
    fused.load_state_dict(plain.state_dict())
    for m in (plain, fused):
        attach_main_grads(m)
    reports: list[torch.nn.Parameter] = []
    setattr(fused.word_embeddings.weight, READY_HOOK, reports.append)
    _run(plain, ids, gs)
    _run(fused, ids, gs)
    assert torch.equal(fused.word_embeddings.weight.main_grad, plain.word_embeddings.weight.main_grad)
    assert fused.word_embeddings.weight.grad is None
    assert reports == [fused.word_embeddings.weight] * 2  # once per backward


def test_a_tied_embedding_keeps_autograd() -> None:
    mcfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                       vocab_size=64, seq_length=16, tie_embeddings=True)  # fmt: skip
    moe = MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=16)
    assert not GPTMoE(mcfg, moe, gradient_accumulation_fusion=True).embedding.gradient_accumulation_fusion
    mcfg.tie_embeddings = False
    assert GPTMoE(mcfg, moe, gradient_accumulation_fusion=True).embedding.gradient_accumulation_fusion


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device tool)")
@pytest.mark.parametrize("V", [32000, 256])
def test_triton_embedding_grad_is_as_exact_and_deterministic(V: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """V=256 sorts uint8 ids, and the largest id ends the sorted ids: a kernel reading past the ids with a -1
    sentinel (255 as uint8) summed rows that are not there (caught on an H100 by the graph tests). One token
    fills 1,500 places (a padding token's run), so its run spans many of the kernel's programs."""
    from trainer.kernels import has_triton

    if not has_triton():
        pytest.skip("needs Triton")
    D = 2048
    ids = [_ids(2, 4096, V, s, "cuda") for s in range(3)]
    ids[0][1, -3:] = V - 1
    ids[1][0, :1500] = 3
    gs = [torch.randn(2, 4096, D, generator=torch.Generator().manual_seed(s)).bfloat16().cuda() for s in range(3)]
    want = torch.zeros(V, D, dtype=torch.float64, device="cuda")
    for i, g in zip(ids, gs):
        want.index_add_(0, i.flatten(), g.reshape(-1, D).double())
    out = {}
    for run, fast in (("a", "1"), ("b", "1"), ("dense", "0")):
        monkeypatch.setenv("MOECTL_TRITON_EMBEDDING_GRAD", fast)
        emb = Embedding(V, D, torch.bfloat16, gradient_accumulation_fusion=True).cuda()
        attach_main_grads(emb)
        _run(emb, ids, gs)
        out[run] = emb.word_embeddings.weight.main_grad
    assert torch.equal(out["a"], out["b"])
    err = {k: float((v.double() - want).abs().max()) for k, v in out.items()}
    assert err["a"] <= err["dense"] and err["a"] < 1e-4, err  # fp32 sums, never rounded to bf16
