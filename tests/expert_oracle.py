"""Eager, autograd-driven expert math for the kernel tests: written independently of the kernels.

The interleaved fc1 layout is undone here with an explicit row permutation (interleaved row
b*2I + h*I + o holds contiguous row h*F + b*I + o), not with the reshape views the kernels use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def deinterleave_index(h_width: int, interleave: int | None) -> torch.Tensor:
    """perm such that h_interleaved[:, perm] == h_contiguous ([gate; up])."""
    if interleave is None:
        return torch.arange(h_width)
    f = h_width // 2
    perm = torch.empty(h_width, dtype=torch.long)
    for b in range(f // interleave):
        for half in range(2):
            for o in range(interleave):
                perm[half * f + b * interleave + o] = b * 2 * interleave + half * interleave + o
    return perm


def eager_act(h_PH: torch.Tensor, activation: str, interleave: int | None) -> torch.Tensor:
    """act(h) straight from the formula, for autograd to differentiate."""
    if activation == "squared_relu":
        return torch.relu(h_PH) ** 2
    hc = h_PH[:, deinterleave_index(h_PH.shape[1], interleave).to(h_PH.device)]
    g, u = hc.chunk(2, dim=1)
    if activation == "swiglu":
        return F.silu(g) * u
    assert activation == "quick_geglu"
    return g * torch.sigmoid(1.702 * g) * u


def loop_expert_mlp(
    x_TD: torch.Tensor,
    w1_EHD: torch.Tensor,
    b1_EH: torch.Tensor | None,
    w2_EDF: torch.Tensor,
    b2_ED: torch.Tensor | None,
    counts: list[int],
    probs_T: torch.Tensor | None,
    activation: str,
    interleave: int | None,
) -> torch.Tensor:
    """y = probs * (fc2(act(fc1(x) + b1)) + b2), one expert at a time, with plain matmuls."""
    outs = []
    start = 0
    for e, n in enumerate(counts):
        xe = x_TD[start : start + n]
        h = xe @ w1_EHD[e].t()
        if b1_EH is not None:
            h = h + b1_EH[e]
        y = eager_act(h, activation, interleave) @ w2_EDF[e].t()
        if b2_ED is not None:
            y = y + b2_ED[e]
        if probs_T is not None:
            y = y * probs_T[start : start + n, None]
        outs.append(y)
        start += n
    return torch.cat(outs) if outs else x_TD.new_zeros(0, w2_EDF.shape[1])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a64, b64 = a.double(), b.double()
    den = b64.norm().item()
    num = (a64 - b64).norm().item()
    return num / den if den else num


def random_problem(activation: str, counts: list[int], with_bias: bool, with_probs: bool, seed: int,
                   d: int = 16, f: int = 24) -> tuple[torch.Tensor | None, ...]:
    """`(x, w1, b1, w2, b2, probs, dy)` of an expert MLP on the CPU in fp32: `counts` rows per expert."""
    g = torch.Generator().manual_seed(seed)
    e, t = len(counts), sum(counts)
    h = f if activation == "squared_relu" else 2 * f
    x = torch.randn(t, d, generator=g)
    w1 = torch.randn(e, h, d, generator=g) / d**0.5
    w2 = torch.randn(e, d, f, generator=g) / f**0.5
    b1 = torch.randn(e, h, generator=g) if with_bias else None
    b2 = torch.randn(e, d, generator=g) if with_bias else None
    probs = torch.rand(t, generator=g) + 0.1 if with_probs else None
    dy = torch.randn(t, d, generator=g)
    return x, w1, b1, w2, b2, probs, dy


def oracle_grads(x, w1, b1, w2, b2, counts, probs, dy, activation, interleave):  # type: ignore[no-untyped-def]
    """`(y, [dx, dw1, db1, dw2, db2, dprobs])`: the per-expert loop under autograd in fp32 on the same
    (maybe bf16-valued) inputs; None where an input is None, zeros where it gets no grad."""
    leaves = [None if t is None else t.detach().float().requires_grad_() for t in (x, w1, b1, w2, b2, probs)]
    y = loop_expert_mlp(*leaves[:5], counts, leaves[5], activation, interleave)
    live = [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(y, live, dy.float(), allow_unused=True))
    grads = []
    for t in leaves:
        g = None if t is None else next(got)
        grads.append(None if t is None else (torch.zeros_like(t) if g is None else g))
    return y.detach(), grads
