"""Muon: momentum orthogonalised by a Newton-Schulz iteration, on fp32 masters.

Formulas, and where they come from:

- `newton_schulz` is Keller Jordan's quintic iteration ("Muon: An optimizer for hidden layers in neural
  networks", kellerjordan.github.io/posts/muon, `zeropower_via_newtonschulz5`): normalise by the
  Frobenius norm (+1e-7) so every singular value is at most 1, work on the wide orientation (transpose
  when rows > cols, so `X @ X.mT` is the smaller Gram matrix), then `steps` times
  `A = X X^T; B = b A + c A A; X = a X + B X` with (a, b, c) = (3.4445, -4.7750, 2.0315). These
  coefficients trade exactness for speed: singular values end in roughly [0.7, 1.2], not at 1.
- the update follows Keller Jordan's `muon_update` (github.com/KellerJordan/Muon): the momentum buffer is
  an EMA, `buf.lerp_(g, 1 - mu)`, Nesterov takes `lerp(g, buf, mu)`, plain momentum takes `buf`. (The
  Moonlight code keeps `buf = mu buf + g`; that differs from the EMA by the factor 1 - mu only, which
  the Frobenius normalisation removes up to its 1e-7.)
- the shape scale is Moonlight's (Liu et al., "Muon is Scalable for LLM Training", arXiv:2502.16982,
  `adjust_lr_for_muon` in its code): the orthogonalised update is multiplied by
  `0.2 * sqrt(max(out, in))`, giving it the RMS of a typical AdamW update (~0.2). Chosen over Keller
  Jordan's `max(1, out/in) ** 0.5` because moectl has one `optimizer.lr` and one `weight_decay` for both
  optimizers of a Muon run (Muon for the matrices, AdamW for the rest), and Moonlight's scale is the one
  that lets both use AdamW's values.
- decoupled weight decay `p *= 1 - lr * wd` before the update (both references), with the unscaled lr.

Compute dtype: fp32 by default. Keller Jordan runs the iteration in bf16 on GPUs for speed; moectl
defaults to fp32 because the update is applied to fp32 masters, dp=N must equal dp=1 to fp32 rounding,
and bf16 matmuls are slow on CPUs. `compute_dtype=torch.bfloat16` is available and tested for
orthogonality only.

Batching: every function works over leading dims, so a grouped `[E, out, in]` expert weight is
orthogonalised per expert slice in one batched call. Each slice is the same math as a per-expert
`[out, in]` weight (the slices never mix: the norm is per slice, the matmuls are batched); on CPU the
results are bitwise equal (tested), which is what makes the two expert layouts train alike.
"""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
MOONLIGHT_RMS = 0.2


def newton_schulz(G: torch.Tensor, steps: int, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximately orthogonalise each trailing `[m, n]` matrix of `G` (returned in `compute_dtype`).

    The result has `G`'s shape; every slice's singular vectors are `G`'s, its singular values are
    pushed towards 1 (into roughly [0.7, 1.2] after 5 steps for a well-conditioned slice).
    """
    if G.dim() < 2:
        raise ValueError(f"Newton-Schulz needs a matrix (or a batch of them), got shape {tuple(G.shape)}")
    if steps < 1:
        raise ValueError(f"Newton-Schulz needs at least one step, got {steps}")
    a, b, c = NS_COEFFICIENTS
    X = G.to(compute_dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:  # iterate on the wide side: the Gram matrix X X^T is min(m, n) square
        X = X.mT
    # Per-slice Frobenius norm >= spectral norm, so every singular value starts in [0, 1].
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) + NS_EPS)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + (c * A) @ A  # Keller Jordan's `b * A + c * A @ A` (left to right), the same rounding
        X = a * X + B @ X
    return X.mT if tall else X


def ns_cost(shape: torch.Size | tuple[int, ...]) -> int:
    """Newton-Schulz cost of a param (up to a constant): `max(m, n) * min(m, n)^2` per trailing matrix.

    A grouped `[E, m, n]` weight costs E matrices. Used to balance layer-wise ownership (Megatron's LPT).
    """
    *lead, m, n = shape
    return math.prod(lead) * max(m, n) * min(m, n) ** 2


def muon_lr_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """Moonlight's update scale `0.2 * sqrt(max(out, in))` of the trailing `[out, in]` matrix."""
    out_features, in_features = shape[-2], shape[-1]
    return MOONLIGHT_RMS * math.sqrt(max(out_features, in_features))


@torch.no_grad()
def muon_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    weight_decay: float,
    compute_dtype: torch.dtype = torch.float32,
) -> None:
    """One Muon step in place on `param` (an fp32 master) and `momentum_buffer`; `grad` is not modified.

    `param`, `grad` and `momentum_buffer` share one shape: `[out, in]`, or `[E, out, in]` for a grouped
    expert weight (each expert slice orthogonalised alone, in one batched Newton-Schulz).
    """
    if not (param.shape == grad.shape == momentum_buffer.shape) or param.dim() < 2:
        raise ValueError(
            f"Muon steps matrices: param {tuple(param.shape)}, grad {tuple(grad.shape)}, "
            f"momentum {tuple(momentum_buffer.shape)}"
        )
    momentum_buffer.lerp_(grad, 1 - momentum)
    update = torch.lerp(grad, momentum_buffer, momentum) if nesterov else momentum_buffer
    ortho = newton_schulz(update, ns_steps, compute_dtype)
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    param.add_(ortho.to(param.dtype), alpha=-lr * muon_lr_scale(param.shape))
