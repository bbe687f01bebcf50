"""Triton GEMMs for Muon's low-precision Newton-Schulz step: symmetric products computed once, no input copies.

Each quintic step is `A = X X^T; B = b A + c A A; X = a X + B X` (`trainer.optim.muon`). With cuBLAS it is
three batched GEMMs, and `baddbmm` first copies its added input (A, then X) into the output, because cuBLAS
accumulates into the tensor it writes: 16.9 ms of the reference model's 84 ms of Newton-Schulz per step on an
H100 (docs/benchmarks.md). Two facts cut the work:

- `A = X X^T` and `A A = A A^T` are symmetric: `gram_` computes only the output tiles on and above the
  diagonal and stores each off-diagonal tile twice (as itself and transposed), 36 of 64 tiles for a
  1024-square output, so the two Gram products cost ~56% of their FLOPs;
- the scaled addition reads its input in the epilogue (`out = alpha * acc + beta * C`), from a tensor other
  than the output: no copy, and the product and the addition round once, as in baddbmm.

`B X` is an ordinary product (`axpby_`). Every kernel takes strides, so a tall slice, which iterates from the
right (`X = a X + X B`), runs as the transposed views (`X^T = a X^T + B X^T`, B symmetric): nothing is copied.

A program owns one output tile of one batch slice; the reduction runs over K in BLOCK_K steps in a fixed
order, so results are reproducible run to run (no autotuning either: a resumed run must pick the same
kernel, or it would not be bitwise). The sizes are compile-time constants: a model has a handful. Shapes
must tile exactly (`fits`); the caller keeps cuBLAS otherwise (`MOECTL_TRITON_NS=0` keeps it always).

Measured on an H100, the reference model's four shape groups, 5 steps: 68.2 ms against cuBLAS's 89.5 ms
(copies included); the kernels run at ~470-500 TFLOP/s of the FLOPs they do, cuBLAS's GEMMs at ~690, so the
gain is the skipped tiles and copies, not a faster GEMM. Imported lazily on CUDA only; needs Triton.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

BLOCK_MN = 128  # the Gram's square output tiles (the mirror of tile (i, j) is tile (j, i)); B X's rows
# (num_warps, num_stages, BLOCK_K) of the Gram kernel and (..., BLOCK_N) of B X: the fastest of a sweep on an
# H100 at the reference model's shapes (docs/benchmarks.md, tenth session)
GRAM_CONFIG = (4, 3, 64)
AXPBY_CONFIG = (8, 3, 64, 256)


def _config(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """A kernel's (num_warps, num_stages, BLOCK_K[, BLOCK_N]); `MOECTL_NS_<NAME>=w,s,k[,n]` overrides it (the
    probe that chose the defaults sweeps with it)."""
    raw = os.environ.get(f"MOECTL_NS_{name}")
    if not raw:
        return default
    return tuple(int(v) for v in raw.split(","))


def fits(m: int, n: int) -> bool:
    """Whether a wide `[m, n]` slice (m <= n) tiles exactly into the kernels' blocks."""
    gram_k = _config("GRAM", GRAM_CONFIG)[2]
    _, _, axpby_k, axpby_n = _config("AXPBY", AXPBY_CONFIG)
    return m % BLOCK_MN == 0 and m % gram_k == 0 and n % gram_k == 0 and m % axpby_k == 0 and n % axpby_n == 0


@lru_cache(maxsize=None)
def _upper_tiles(tiles: int, device: torch.device) -> torch.Tensor:
    """The (row, col) tile pairs with row <= col, as an int32 `[pairs, 2]` table on `device`."""
    pairs = [(i, j) for i in range(tiles) for j in range(i, tiles)]
    return torch.tensor(pairs, dtype=torch.int32, device=device)


@triton.jit
def _gram_kernel(y_ptr, c_ptr, out_ptr, pairs_ptr, K: tl.constexpr, sy_b, sy_m, sy_k, sc_b, sc_m, sc_n, so_b,
                 so_m, so_n, alpha, beta, HAS_C: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ti = tl.load(pairs_ptr + 2 * pid)
    tj = tl.load(pairs_ptr + 2 * pid + 1)
    rm = (ti * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    rn = (tj * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    y = y_ptr + b * sy_b
    a_ptrs = y + rm[:, None] * sy_m + rk[None, :] * sy_k  # [BLOCK, BLOCK_K] rows of tile i
    b_ptrs = y + rn[:, None] * sy_m + rk[None, :] * sy_k  # [BLOCK, BLOCK_K] rows of tile j
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):
        acc = tl.dot(tl.load(a_ptrs), tl.trans(tl.load(b_ptrs)), acc)
        a_ptrs += BLOCK_K * sy_k
        b_ptrs += BLOCK_K * sy_k
    acc = acc * alpha
    if HAS_C:
        acc += beta * tl.load(c_ptr + b * sc_b + rm[:, None] * sc_m + rn[None, :] * sc_n).to(tl.float32)
    val = acc.to(out_ptr.dtype.element_ty)
    o = out_ptr + b * so_b
    tl.store(o + rm[:, None] * so_m + rn[None, :] * so_n, val)
    if ti != tj:  # the mirror tile, the same rounded values: the output is exactly symmetric
        tl.store(o + rn[None, :] * so_m + rm[:, None] * so_n, val)


@triton.jit
def _axpby_kernel(l_ptr, r_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, sl_b, sl_m, sl_k, sr_b, sr_k, sr_n, so_b,
                  so_m, so_n, alpha, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    tiles_n = N // BLOCK_N
    rm = ((pid // tiles_n) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    rn = ((pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    r = r_ptr + b * sr_b
    a_ptrs = l_ptr + b * sl_b + rm[:, None] * sl_m + rk[None, :] * sl_k  # [BLOCK, BLOCK_K] of L
    b_ptrs = r + rk[:, None] * sr_k + rn[None, :] * sr_n  # [BLOCK_K, BLOCK_N] of R
    acc = tl.zeros((BLOCK, BLOCK_N), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):
        acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)
        a_ptrs += BLOCK_K * sl_k
        b_ptrs += BLOCK_K * sr_k
    acc += alpha * tl.load(r + rm[:, None] * sr_k + rn[None, :] * sr_n).to(tl.float32)  # R's rows are L's cols
    tl.store(out_ptr + b * so_b + rm[:, None] * so_m + rn[None, :] * so_n, acc.to(out_ptr.dtype.element_ty))


def gram_(y: torch.Tensor, out: torch.Tensor, alpha: float = 1.0, beta: float = 0.0,
          c: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`out = alpha * y @ y.mT + beta * c` for `[B, m, k]` `y` (any strides) into `[B, m, m]` `out`.

    The result is exactly symmetric. `c` must be symmetric (it is read on and above the diagonal only).
    """
    batch, m, k = y.shape
    warps, stages, block_k = _config("GRAM", GRAM_CONFIG)
    assert out.shape == (batch, m, m) and m % BLOCK_MN == 0 and k % block_k == 0, (tuple(y.shape), tuple(out.shape))
    pairs = _upper_tiles(m // BLOCK_MN, y.device)
    cc = c if c is not None else out  # not read without HAS_C
    _gram_kernel[(pairs.shape[0], batch)](
        y, cc, out, pairs, k, *y.stride(), *cc.stride(), *out.stride(), alpha, beta, HAS_C=c is not None,
        BLOCK=BLOCK_MN, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def axpby_(l: torch.Tensor, r: torch.Tensor, out: torch.Tensor, alpha: float) -> torch.Tensor:
    """`out = l @ r + alpha * r` for `[B, m, m]` `l` and `[B, m, n]` `r` (any strides; `out` must not alias `r`)."""
    batch, m, n = r.shape
    warps, stages, block_k, block_n = _config("AXPBY", AXPBY_CONFIG)
    assert l.shape == (batch, m, m) and out.shape == r.shape, (tuple(l.shape), tuple(r.shape))
    assert m % BLOCK_MN == 0 and m % block_k == 0 and n % block_n == 0, (tuple(l.shape), tuple(r.shape))
    _axpby_kernel[((m // BLOCK_MN) * (n // block_n), batch)](
        l, r, out, n, m, *l.stride(), *r.stride(), *out.stride(), alpha, BLOCK=BLOCK_MN, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def iterate(x: torch.Tensor, steps: int, coefficients: tuple[float, float, float], tall: bool) -> torch.Tensor:
    """`steps` quintic steps on `[B, rows, cols]` `x` (consumed), as `muon._iterate_fused` runs them with cuBLAS.

    A tall slice (rows > cols) runs on the transposed views. Returns a tensor of `x`'s shape and strides
    (`x` itself or its one ping-pong buffer).
    """
    a, b, c = coefficients
    cur, nxt = x, torch.empty_like(x)
    wide = (lambda t: t.mT) if tall else (lambda t: t)
    batch, m, _ = wide(x).shape
    A = torch.empty(batch, m, m, dtype=x.dtype, device=x.device)
    B = torch.empty_like(A)
    for _ in range(steps):
        gram_(wide(cur), A)
        gram_(A, B, alpha=c, beta=b, c=A)
        axpby_(B, wide(cur), wide(nxt), a)
        cur, nxt = nxt, cur
    return cur
