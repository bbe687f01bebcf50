"""expert_math.fused_forward/fused_backward (the fused activation's reference): forward and the hand-written backward against autograd of the eager formula (fp32)."""

from __future__ import annotations

import pytest
import torch

from expert_oracle import eager_act, rel_err
from trainer.moe import expert_math as ref

ACTS = ["swiglu", "quick_geglu", "squared_relu"]


def _inputs(activation: str, rows: int = 29, f: int = 24, experts: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = f * (1 if activation == "squared_relu" else 2)
    h_PH = torch.randn(rows, h, generator=g, dtype=torch.float64).float()
    probs_P = torch.rand(rows, generator=g).float() + 0.1
    bias_EH = torch.randn(experts, h, generator=g).float()
    expert_P = torch.randint(0, experts, (rows,), generator=g)
    return h_PH, probs_P, bias_EH, expert_P


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("interleave", [None, 4, 8])
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_and_backward_match_autograd(activation, interleave, with_probs, with_bias):
    h_PH, probs_P, bias_EH, expert_P = _inputs(activation, seed=ACTS.index(activation) * 10 + (interleave or 0))
    probs = probs_P if with_probs else None
    bias = bias_EH if with_bias else None
    experts = expert_P if with_bias else None

    # Eager formula under autograd, in float64 so the oracle is exact to far below fp32 rounding.
    h64 = h_PH.double().requires_grad_()
    p64 = probs_P.double().requires_grad_() if with_probs else None
    hb = h64 + bias_EH.double()[expert_P] if with_bias else h64
    a64 = eager_act(hb, activation, interleave)
    if p64 is not None:
        a64 = a64 * p64[:, None]
    da = torch.randn_like(a64)
    grads = torch.autograd.grad(a64, [h64] + ([p64] if p64 is not None else []), da)

    a = ref.fused_forward(h_PH, probs, activation, interleave, bias, experts)
    assert a.dtype == h_PH.dtype and a.shape == a64.shape
    assert rel_err(a, a64) < 1e-6

    dh, dprobs, a_again = ref.fused_backward(h_PH, probs, da.float(), activation, interleave, bias, experts)
    assert rel_err(dh, grads[0]) < 1e-6
    assert torch.equal(a_again, a)  # the backward's recomputed activation is the forward's, bit for bit
    if with_probs:
        assert dprobs is not None and dprobs.shape == probs_P.shape
        assert rel_err(dprobs, grads[1]) < 1e-6
    else:
        assert dprobs is None


def test_interleaved_layout_reads_the_right_rows():
    """A hand-built interleaved h (I=2, F=4) with gate = 1, up = column index: a = silu(1) * index."""
    f, i = 4, 2
    gate = torch.ones(1, f)
    up = torch.arange(f, dtype=torch.float32)[None]
    # interleaved row b*2I + h*I + o == contiguous row h*F + b*I + o
    h = torch.cat([gate[:, 0:2], up[:, 0:2], gate[:, 2:4], up[:, 2:4]], dim=1)
    a = ref.fused_forward(h, None, "swiglu", interleave=i)
    assert torch.allclose(a, torch.nn.functional.silu(torch.ones(())) * up)


def test_bf16_io_keeps_dtype_and_stays_close():
    h_PH, probs_P, _, _ = _inputs("swiglu")
    a32 = ref.fused_forward(h_PH, probs_P, "swiglu")
    a16 = ref.fused_forward(h_PH.bfloat16(), probs_P, "swiglu")
    assert a16.dtype == torch.bfloat16
    assert rel_err(a16, a32) < 1e-2


def test_bad_arguments_are_rejected():
    h = torch.randn(3, 12)
    with pytest.raises(ValueError, match="unknown expert activation"):
        ref.fused_forward(h, None, "gelu")
    with pytest.raises(ValueError, match="glu_interleave_size"):
        ref.fused_forward(h, None, "swiglu", interleave=4)  # F = 6 is not a multiple of 4
    with pytest.raises(ValueError, match="expert_T"):
        ref.fused_forward(h, None, "swiglu", b1_EH=torch.zeros(2, 12))
