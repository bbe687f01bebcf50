"""The language-model loss (trainer/cross_entropy.py).

CPU: the op `lm_cross_entropy` (as torch ops off CUDA) against `F.cross_entropy(logits.float())`: the loss to
fp32 rounding and the logits' grad to bf16 rounding for any upstream grad, ignored targets counting for
nothing, a NaN mean with no counted target as torch gives; the op traced by `torch.compile` (aot_eager);
`cross_entropy` off the fused path is `F.cross_entropy` bit for bit. The Triton kernels are tested on GPUs
(tests/trainer/kernels/test_cross_entropy_triton.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.cross_entropy import IGNORE_INDEX, cross_entropy


def _loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, fused: bool, upstream: float):
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, targets, fused)
    (loss * upstream).backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("ignored", [0, 5])
@pytest.mark.parametrize("upstream", [1.0, 0.25, 1 / 3])
def test_the_op_is_f_cross_entropy(ignored: int, upstream: float) -> None:
    g = torch.Generator().manual_seed(ignored)
    logits = (torch.randn(24, 300, generator=g) * 4).bfloat16()
    targets = torch.randint(0, 300, (24,), generator=g)
    targets[:ignored] = IGNORE_INDEX
    loss, grad = _loss_and_grad(logits, targets, True, upstream)
    want_loss, want_grad = _loss_and_grad(logits, targets, False, upstream)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=2**-7, atol=1e-9)
    assert torch.count_nonzero(grad[:ignored]) == 0 and grad.dtype == torch.bfloat16


def test_no_counted_target_gives_nan_as_torch_does() -> None:
    logits = torch.randn(4, 10).bfloat16()
    targets = torch.full((4,), IGNORE_INDEX)
    loss, grad = _loss_and_grad(logits, targets, True, 1.0)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits.float(), targets))
    assert torch.count_nonzero(grad) == 0


def test_the_op_traces_under_compile() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=g).bfloat16()
    targets = torch.randint(0, 50, (8,), generator=g)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, t: cross_entropy(x, t, True), backend="aot_eager", fullgraph=True)
    x = logits.clone().requires_grad_()
    loss = compiled(x, targets)
    loss.backward()
    want_loss, want_grad = _loss_and_grad(logits, targets, True, 1.0)
    assert torch.equal(loss.detach(), want_loss) and torch.equal(x.grad, want_grad)


def test_the_unfused_path_is_f_cross_entropy_bitwise() -> None:
    logits = torch.randn(6, 40).bfloat16()
    targets = torch.randint(0, 40, (6,))
    assert torch.equal(cross_entropy(logits, targets), F.cross_entropy(logits.float(), targets))


def test_the_side_outputs_carry_no_grad() -> None:
    """The log-sum-exp and the count are the backward's inputs: marked non-differentiable, so a loss built on
    them (a z-loss, say) cannot get a silently wrong (zero) grad through the op."""
    from trainer.cross_entropy import lm_cross_entropy

    x = torch.randn(4, 10).bfloat16().requires_grad_()
    loss, lse, count = lm_cross_entropy(x, torch.randint(0, 10, (4,)))
    assert loss.requires_grad and not lse.requires_grad and not count.requires_grad
