"""The Gram Newton-Schulz iteration, one implementation for both backends: the symmetric products on Triton
(`kernels/ns_gemm_triton.symm_`, CUDA) or in torch (`symm_torch`, everywhere else and in the CPU tests).

`muon._iterate_gram` says why iterating on the `[m, m]` Gram side is the same polynomial as Keller Jordan's
quintic steps on X, and why it restarts; this module runs it. Per phase of up to `restart` steps: `R = X X^T`
in `gram_dtype` (fp16 for a low-precision X), then per step `Z = b R + c R^2`, the phase's product
`Q <- Q (a I + Z)` and, unless the phase ends, `R <- (a I + Z)^2 R` (two products). The `a` terms are added in
fp32 with the products (`symm`'s added inputs and diagonal), so no rounding sees the 3.4 on the diagonal; the
second step's `Q = (a I + Z_0)(a I + Z_1)` is expanded, so `a I + Z_0` is never stored. Every product is of
polynomials in one R, so symmetric: a `symm` computes the upper triangle and mirrors it. The phase ends with one
plain product `X <- Q X` in X's dtype (cuBLAS on CUDA; Q's last product writes it so, with the first phase's
normalisation `scale` folded in), and the next phase restarts from a true Gram. A one-step phase is
`Q = a I + b R + c R^2`, one product.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch


class Symm(Protocol):
    """`out = s^p (alpha y @ z.mT + beta c + beta2 c2 + diag I)`, exactly symmetric (the upper triangle mirrored),
    accumulated in fp32 (or wider) and rounded once to `out`'s dtype; `s` the fp32 `[B]` `scale` or 1
    (`ns_gemm_triton.symm_`). Passing one tensor as both `y` and `z` is the Gram `y y^T`, whose kernel is the one
    measured (`symm_` mirrors diagonal tiles only where `z is not y`)."""

    def __call__(self, y: torch.Tensor, z: torch.Tensor, out: torch.Tensor, alpha: float = 1.0, beta: float = 0.0,
                 c: Optional[torch.Tensor] = None, beta2: float = 0.0, c2: Optional[torch.Tensor] = None,
                 scale: Optional[torch.Tensor] = None, diag: float = 0.0,
                 scale_power: int = 2) -> torch.Tensor: ...  # fmt: skip


def symm_torch(y: torch.Tensor, z: torch.Tensor, out: torch.Tensor, alpha: float = 1.0, beta: float = 0.0,
               c: Optional[torch.Tensor] = None, beta2: float = 0.0, c2: Optional[torch.Tensor] = None,
               scale: Optional[torch.Tensor] = None, diag: float = 0.0,
               scale_power: int = 2) -> torch.Tensor:  # fmt: skip
    """`Symm` in torch: the Triton kernel's formula, accumulated in fp32 (fp64 for fp64 operands) in torch's
    summation order, the upper triangle mirrored, one rounding into `out`. Refuses what `symm_` refuses or must
    not be given: another `scale_power`, mismatched shapes, an `out` that is one of the inputs."""
    if scale_power not in (1, 2):
        raise ValueError(f"scale_power must be 1 or 2, got {scale_power}")
    batch, m, _ = y.shape
    if z.shape != y.shape or out.shape != (batch, m, m):
        raise ValueError(f"symm of {tuple(y.shape)} and {tuple(z.shape)} into {tuple(out.shape)}")
    if any(t is not None and t.data_ptr() == out.data_ptr() for t in (y, z, c, c2)):
        raise ValueError("symm: out is one of its inputs (the kernel reads tiles other programs write)")
    acc_dt = torch.float64 if y.dtype == torch.float64 else torch.float32
    acc = torch.bmm(y.to(acc_dt), z.to(acc_dt).mT)
    if alpha != 1.0:
        acc *= alpha
    if c is not None:
        acc += beta * c.to(acc_dt)
    if c2 is not None:
        acc += beta2 * c2.to(acc_dt)
    if diag:
        acc.diagonal(dim1=-2, dim2=-1).add_(diag)
    if scale is not None:
        acc *= (scale.to(acc_dt) ** scale_power)[:, None, None]
    upper = torch.triu(acc)
    out.copy_(upper + torch.triu(acc, diagonal=1).mT)
    return out


def iterate_gram(x: torch.Tensor, steps: int, coefficients: tuple[float, float, float], tall: bool,
                 scale: Optional[torch.Tensor], gram_dtype: torch.dtype, restart: int,
                 symm: Symm) -> torch.Tensor:  # fmt: skip
    """`steps` quintic steps on `[B, rows, cols]` `x` (consumed) as a Gram Newton-Schulz (the module docstring),
    with `symm` for the symmetric products. A tall slice (rows > cols) iterates from the right (`X^T X`, `X Q`).
    `scale`: fp32 `[B]`, each slice's `1 / (|X| + eps)` when `x` is not yet normalised (`s^2` in the first Gram,
    `s` in the first phase's last Q; an fp16 X is scaled first instead, as `s Q` may overflow fp16: `s = 1e7`
    for a zero slice). Returns a tensor of `x`'s shape and strides (`x` itself or its one ping-pong buffer)."""
    a, b, c = coefficients
    wide = (lambda t: t.mT) if tall else (lambda t: t)
    batch, m, _ = wide(x).shape
    if scale is not None and x.dtype == torch.float16:
        x.mul_(scale[:, None, None])  # computed in fp32, rounded once
        scale = None

    def square(dtype: torch.dtype = gram_dtype) -> torch.Tensor:
        return torch.empty(batch, m, m, dtype=dtype, device=x.device)

    R, RZ, Zs, Q_x = square(), square(), (square(), square()), square(x.dtype)
    Qs: list[Optional[torch.Tensor]] = [None, None]  # a phase's running Q: one buffer for 3 steps, two from 4

    def q_buffer(k: int) -> torch.Tensor:
        if Qs[k] is None:
            Qs[k] = square()
        return Qs[k]  # type: ignore[return-value]

    cur, nxt = x, torch.empty_like(x)
    done = 0
    while done < steps:
        n = min(restart, steps - done)
        w = wide(cur)
        symm(w, w, R, scale=scale)  # the normalised Gram: s^2 X X^T (one operand: the Triton Gram's own case)
        last_scale = dict(scale=scale, scale_power=1) if scale is not None else {}
        Q: Optional[torch.Tensor] = None
        for i in range(n):
            final = i == n - 1
            if n == 1:  # a one-step phase: Q = a I + b R + c R^2, in one product
                symm(R, R, Q_x, alpha=c, beta=b, c=R, diag=a, **last_scale)
                break
            Z, Z_prev = Zs[i % 2], Zs[(i + 1) % 2]
            symm(R, R, Z, alpha=c, beta=b, c=R)
            out = Q_x if final else q_buffer(i % 2)
            sc = last_scale if final else {}
            if i == 1:  # (a I + Z_1)(a I + Z_0), expanded: Q_0 = a I + Z_0 is never stored
                symm(Z_prev, Z, out, beta=a, c=Z, beta2=a, c2=Z_prev, diag=a * a, **sc)
                Q = out
            elif i > 1:
                assert Q is not None
                symm(Q, Z, out, beta=a, c=Q, **sc)
                Q = out
            if not final:
                symm(R, Z, RZ, beta=a, c=R)  # R (a I + Z)
                symm(Z, RZ, R, beta=a, c=RZ)  # (a I + Z) R (a I + Z)
        # Q_x is symmetric: a tall slice's X^T <- Q X^T is X <- X Q
        torch.bmm(cur, Q_x, out=nxt) if tall else torch.bmm(Q_x, cur, out=nxt)
        cur, nxt = nxt, cur
        scale = None
        done += n
    return cur
