"""The Triton kernels of the language-model loss (trainer/kernels/cross_entropy_triton.py), on GPUs (marked
`gpu`): the op against `F.cross_entropy(logits.float())` on the same device, the loss to fp32 rounding (1e-6
relative) and the logits' grad to bf16 rounding, at the reference vocabulary and an odd one, with ignored
targets and a non-unit upstream grad; run to run bitwise."""

from __future__ import annotations

import pytest
import torch

from trainer.cross_entropy import IGNORE_INDEX, cross_entropy
from trainer.kernels import has_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device tool)"),
]


@pytest.mark.parametrize("V", [32000, 50257, 1000])
def test_kernels_are_f_cross_entropy_to_rounding(V: int) -> None:
    if not has_triton():
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(V)
    N = 4096
    logits = (torch.randn(N, V, generator=g) * 3).bfloat16().cuda()
    targets = torch.randint(0, V, (N,), generator=g).cuda()
    targets[::7] = IGNORE_INDEX
    res = {}
    for run, fused in (("a", True), ("b", True), ("torch", False)):
        x = logits.clone().requires_grad_()
        loss = cross_entropy(x, targets, fused)
        (loss * 0.25).backward()
        res[run] = (loss.detach(), x.grad)
    assert torch.equal(res["a"][0], res["b"][0]) and torch.equal(res["a"][1], res["b"][1])
    torch.testing.assert_close(res["a"][0], res["torch"][0], rtol=1e-6, atol=0)
    torch.testing.assert_close(res["a"][1].float(), res["torch"][1].float(), rtol=2**-7, atol=1e-10)
    assert torch.count_nonzero(res["a"][1][::7]) == 0


def test_a_target_outside_the_vocabulary_makes_the_loss_nan() -> None:
    """No read outside the row (torch's kernel would stop the process with a device-side assert): the loss is
    NaN, which the step's non-finite guard reports."""
    if not has_triton():
        pytest.skip("needs Triton")
    logits = torch.randn(8, 1000, device="cuda").bfloat16()
    targets = torch.randint(0, 1000, (8,), device="cuda")
    assert torch.isfinite(cross_entropy(logits, targets, True))
    targets[-1] = 1000
    assert torch.isnan(cross_entropy(logits, targets, True))
