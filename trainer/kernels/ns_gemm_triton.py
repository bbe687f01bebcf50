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

`B X` is an ordinary product. By default (`iterate`'s `bx`) the kernel that builds B also adds `a` on its
diagonal before the one rounding, `B' = a I + b A + c A A`, and `X = B' X` is a plain cuBLAS `bmm`, which
runs this non-symmetric product faster (~710 TFLOP/s against `axpby_`'s ~600; the reference model's four
shape groups 62.9 -> 57.2 ms on an H100, and 0.0086 vs 0.0097 relative error against fp32: one rounding of
`a + B_ii` costs no more than the epilogue add); a tall slice, which iterates from the right, multiplies
`X B'`. `axpby_` (`MOECTL_NS_BX=triton`, and fp16's first step) adds `a X` in its epilogue instead. Every
Triton kernel takes strides, so with `axpby_` a tall slice runs as the transposed views (`X^T = a X^T +
B X^T`, B symmetric): nothing is copied.

The first step can also take each slice's normalisation (`scale`, `1 / (|X| + eps)`) in its epilogues: with
`X' = s X`, `A = s^2 X X^T` and the next X is `s (a X + B X)`, so Muon's pass that divides X by its norm is
gone (`muon.orthogonalize_` with the blend's sums of squares), and `X / |X|` is never rounded to bf16.
With the cuBLAS product the first step's B takes `s` once instead (`s B' X = B' (s X)`).

Two kernel families, the same sums in the same order (bitwise equal on an H100, measured): on Hopper and
later the operands arrive by TMA (`_gram_kernel_tma`, `_axpby_kernel_tma`: a tall slice's transposed view is
read as its own storage and transposed in shared memory); elsewhere, or for other layouts, pointer loads. A
program owns one output tile of one batch slice (or two row tiles, below); the reduction runs
over K in BLOCK_K steps in a fixed order, so results are reproducible run to run (no autotuning either: a
resumed run must pick the same kernel, or it would not be bitwise). The sizes are compile-time constants: a
model has a handful. Shapes must tile exactly (`fits`); the caller keeps cuBLAS otherwise
(`MOECTL_TRITON_NS=0` keeps it always, `MOECTL_NS_TMA=0` the pointer kernels).

Where the Gram side spans an even number of tiles, a TMA program computes two row tiles against one column
tile (`_gram_kernel_tma` with `ROWS` 2, 8 warps): the column tile's operand is loaded once for both, at the
price of one wasted tile below the diagonal per row pair (40 computed for 36 needed at a 1024 side). Bitwise
equal to one tile per program (tested); the four shape groups 57.97 -> 56.19 ms on an H100 with (8, 4, 64),
the best of four configs (`MOECTL_NS_GRAM2=0` keeps one tile per program).

Measured on an H100, the reference model's four shape groups, 5 steps: cuBLAS 89.3 ms (copies included),
pointer kernels 68.2-70.3 ms, TMA 65.2-65.9 ms. Of the gate/up group's products, per step: `X X^T` at 516
TFLOP/s of the FLOPs done (931 counted as the full product, cuBLAS's full product 788), `b A + c A A` at 443
(787), `a X + B X` at 601 (cuBLAS's bare `B X` 711, its baddbmm with the copy 418). A persistent variant
(one program per SM walking the tiles, the next tile's loads issued under the epilogue) measured no faster
(65.5 ms) and was dropped.

The Gram Newton-Schulz (`optimizer.muon_ns_method`; `optim/muon_gram.iterate_gram` with `symm_`) runs
the same polynomial on the `[m, m]` side: per step four symmetric products of commuting matrices (`symm_`,
the Gram kernel with a second operand for the column tiles and a second added input) instead of the two
`m x n` products of X, plus one `Q X` per 3-step phase. At the expert shapes (`n = 2m`) 14 symmetric products, 2
Grams of X and 2 cuBLAS `Q X` replace 5 x (2 Grams + `B'X`): gate/up 35.25 -> 29.30 ms and fc2 18.74 -> 14.57
ms on an H100 for the reference model's 768 slices; at the 1.5 and 1 aspects of its attention weights it is
no faster (3.16 -> 3.30, 2.38 -> 2.72), so `auto` leaves those on the standard chain.

Imported lazily on CUDA only; needs Triton.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from trainer.kernels import capability
from trainer.switches import switched_off

BLOCK_MN = 128  # the Gram's square output tiles (the mirror of tile (i, j) is tile (j, i)); B X's rows
# (num_warps, num_stages, BLOCK_K) of the Gram kernel and (..., BLOCK_N) of B X: the fastest of a sweep on an
# H100 at the reference model's shapes (docs/benchmarks.md, tenth session)
GRAM_CONFIG = (4, 3, 64)
AXPBY_CONFIG = (8, 3, 64, 256)
# the same for the TMA kernels (Hopper and later), from a sweep of 14 configs (docs/benchmarks.md, eleventh session)
GRAM_TMA_CONFIG = (4, 3, 64)
AXPBY_TMA_CONFIG = (8, 4, 64, 256)
# two row tiles per TMA Gram program (ROWS 2): the best of four (docs/benchmarks.md, eighteenth session)
GRAM2_TMA_CONFIG = (8, 4, 64)
BX_ENV = "MOECTL_NS_BX"  # who multiplies B into X in each step (`iterate`)
BX_PATHS = ("cublas", "triton")


def _two_row_tiles(m: int) -> bool:
    """Whether the TMA Gram runs two row tiles per program (`_gram_kernel_tma`'s `ROWS`): an even number of tiles,
    unless `MOECTL_NS_GRAM2=0`."""
    return (m // BLOCK_MN) % 2 == 0 and not switched_off("MOECTL_NS_GRAM2")


def _config(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """A kernel's (num_warps, num_stages, BLOCK_K[, BLOCK_N]); `MOECTL_NS_<NAME>=w,s,k[,n]` overrides it (the
    probe that chose the defaults sweeps with it)."""
    raw = os.environ.get(f"MOECTL_NS_{name}")
    if not raw:
        return default
    return tuple(int(v) for v in raw.split(","))


def fits(m: int, n: int) -> bool:
    """Whether a wide `[m, n]` slice (m <= n) tiles exactly into the kernels' blocks."""
    for gram, axpby in ((("GRAM", GRAM_CONFIG), ("AXPBY", AXPBY_CONFIG)),
                        (("GRAM_TMA", GRAM_TMA_CONFIG), ("AXPBY_TMA", AXPBY_TMA_CONFIG)),
                        (("GRAM2_TMA", GRAM2_TMA_CONFIG), ("AXPBY_TMA", AXPBY_TMA_CONFIG))):  # fmt: skip
        gram_k = _config(*gram)[2]
        _, _, axpby_k, axpby_n = _config(*axpby)
        if m % BLOCK_MN or m % gram_k or n % gram_k or m % axpby_k or n % axpby_n:
            return False
    return True


@lru_cache(maxsize=None)
def _upper_tiles(tiles: int, device: torch.device) -> torch.Tensor:
    """The (row, col) tile pairs with row <= col, as an int32 `[pairs, 2]` table on `device`."""
    pairs = [(i, j) for i in range(tiles) for j in range(i, tiles)]
    return torch.tensor(pairs, dtype=torch.int32, device=device)


@lru_cache(maxsize=None)
def _upper_tile_pairs(tiles: int, device: torch.device) -> torch.Tensor:
    """For two row tiles per TMA Gram program: (first row tile, col) with the first row tile even and col >= it,
    as an int32 `[programs, 2]` table on `device` (`tiles` even)."""
    pairs = [(i, j) for i in range(0, tiles, 2) for j in range(i, tiles)]
    return torch.tensor(pairs, dtype=torch.int32, device=device)


@triton.jit
def _gram_kernel(y_ptr, z_ptr, c_ptr, c2_ptr, out_ptr, s_ptr, pairs_ptr, K: tl.constexpr, sy_b, sy_m, sy_k, sz_b,
                 sz_m, sz_k, sc_b, sc_m, sc_n, sc2_b, sc2_m, sc2_n, so_b, so_m, so_n, alpha, beta, beta2, diag,
                 HAS_C: tl.constexpr, HAS_C2: tl.constexpr, HAS_S: tl.constexpr, HAS_D: tl.constexpr,
                 SCALE_POW: tl.constexpr, MIRROR_DIAG: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    # rows of tile i from y, rows of tile j from z (z is y for a Gram)
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ti = tl.load(pairs_ptr + 2 * pid)
    tj = tl.load(pairs_ptr + 2 * pid + 1)
    rm = (ti * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    rn = (tj * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = y_ptr + b * sy_b + rm[:, None] * sy_m + rk[None, :] * sy_k  # [BLOCK, BLOCK_K] rows of tile i
    b_ptrs = z_ptr + b * sz_b + rn[:, None] * sz_m + rk[None, :] * sz_k  # [BLOCK, BLOCK_K] rows of tile j
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):
        acc = tl.dot(tl.load(a_ptrs), tl.trans(tl.load(b_ptrs)), acc)
        a_ptrs += BLOCK_K * sy_k
        b_ptrs += BLOCK_K * sz_k
    acc = acc * alpha
    if HAS_C:
        acc += beta * tl.load(c_ptr + b * sc_b + rm[:, None] * sc_m + rn[None, :] * sc_n).to(tl.float32)
    if HAS_C2:
        acc += beta2 * tl.load(c2_ptr + b * sc2_b + rm[:, None] * sc2_m + rn[None, :] * sc2_n).to(tl.float32)
    if HAS_D:  # a I + ...: B X then needs no added input (one rounding, as the epilogue add had)
        acc += tl.where(rm[:, None] == rn[None, :], diag, 0.0)
    if HAS_S:  # the slice's normalisation folded in: (s X)(s X)^T, or s B for B (s X)
        sb = tl.load(s_ptr + b)
        acc = acc * (sb * sb) if SCALE_POW == 2 else acc * sb
    val = acc.to(out_ptr.dtype.element_ty)
    if MIRROR_DIAG:  # y != z: a diagonal tile's two triangles are two roundings; keep the upper one for both
        if ti == tj:
            d_idx = tl.arange(0, BLOCK)
            val = tl.where(d_idx[:, None] <= d_idx[None, :], val, tl.trans(val))
    o = out_ptr + b * so_b
    tl.store(o + rm[:, None] * so_m + rn[None, :] * so_n, val)
    if ti != tj:  # the mirror tile, the same rounded values: the output is exactly symmetric
        tl.store(o + rn[None, :] * so_m + rm[:, None] * so_n, val)


@triton.jit
def _axpby_kernel(l_ptr, r_ptr, out_ptr, s_ptr, N: tl.constexpr, K: tl.constexpr, sl_b, sl_m, sl_k, sr_b, sr_k, sr_n,
                  so_b, so_m, so_n, alpha, HAS_S: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):  # fmt: skip
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
    if HAS_S:  # s (L R + alpha R): R unnormalised, L from the scaled Grams
        acc = acc * tl.load(s_ptr + b)
    tl.store(out_ptr + b * so_b + rm[:, None] * so_m + rn[None, :] * so_n, acc.to(out_ptr.dtype.element_ty))


try:  # Triton >= 3.3: host-side TMA descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer kernels only
    TensorDescriptor = None


@triton.jit
def _gram_epilogue_tma(acc, b, i0, j0, c_desc, c2_desc, out_desc, s_ptr, M: tl.constexpr, alpha, beta, beta2, diag,
                       HAS_C: tl.constexpr, HAS_C2: tl.constexpr, HAS_S: tl.constexpr, HAS_D: tl.constexpr,
                       SCALE_POW: tl.constexpr, MIRROR_DIAG: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # the output tile (i0, j0) of slice b, on or above the diagonal, and its mirror
    acc = acc * alpha
    if HAS_C:
        acc += beta * c_desc.load([b * M + i0, j0]).to(tl.float32)
    if HAS_C2:
        acc += beta2 * c2_desc.load([b * M + i0, j0]).to(tl.float32)
    if HAS_D:
        if i0 == j0:
            d_idx = tl.arange(0, BLOCK)
            acc += tl.where(d_idx[:, None] == d_idx[None, :], diag, 0.0)
    if HAS_S:  # the slice's normalisation folded in: (s X)(s X)^T, or s B for B (s X)
        sb = tl.load(s_ptr + b)
        acc = acc * (sb * sb) if SCALE_POW == 2 else acc * sb
    val = acc.to(out_desc.dtype)
    if MIRROR_DIAG:  # y != z: a diagonal tile's two triangles are two roundings; keep the upper one for both
        if i0 == j0:
            d_idx = tl.arange(0, BLOCK)
            val = tl.where(d_idx[:, None] <= d_idx[None, :], val, val.T)
    out_desc.store([b * M + i0, j0], val)
    if i0 != j0:  # the mirror tile, the same rounded values
        out_desc.store([b * M + j0, i0], val.T)


@triton.jit
def _gram_kernel_tma(y_desc, z_desc, c_desc, c2_desc, out_desc, s_ptr, pairs_ptr, M: tl.constexpr, K: tl.constexpr,
                     alpha, beta, beta2, diag, HAS_C: tl.constexpr, HAS_C2: tl.constexpr, HAS_S: tl.constexpr,
                     HAS_D: tl.constexpr, SCALE_POW: tl.constexpr, MIRROR_DIAG: tl.constexpr, TRANS_Y: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr):  # fmt: skip
    # y's storage as rows: `[B*M, K]` (TRANS_Y false) or, for the transposed view of a tall slice, `[B*K, M]`;
    # z, the column tiles' operand, laid out as y (z is y for a Gram); c, c2 and out `[B*M, M]`. The sums run
    # in the pointer kernel's order (K ascending). ROWS row tiles (i0, and
    # with 2 also i0 + BLOCK) against one column tile j0 >= i0: the column tile's operand is loaded once for
    # both. With ROWS 2 and j0 == i0 the lower tile is below the diagonal: computed (the loop stays
    # branch-free) but not stored; its mirror is the upper tile of program (i0, j0 + BLOCK).
    pid = tl.program_id(0)
    b = tl.program_id(1)
    i0 = tl.load(pairs_ptr + 2 * pid) * BLOCK
    j0 = tl.load(pairs_ptr + 2 * pid + 1) * BLOCK
    i1 = i0 + BLOCK
    acc0 = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)  # ROWS == 2 only
    if TRANS_Y:
        for kk in tl.range(0, K // BLOCK_K, num_stages=STAGES):
            r = b * K + kk * BLOCK_K
            if ROWS == 1:  # the row tile's operand issued first, as the kernel was tuned
                acc0 = tl.dot(y_desc.load([r, i0]).T, z_desc.load([r, j0]), acc0)
            else:
                col = z_desc.load([r, j0])
                acc0 = tl.dot(y_desc.load([r, i0]).T, col, acc0)
                acc1 = tl.dot(y_desc.load([r, i1]).T, col, acc1)
    else:
        for kk in tl.range(0, K // BLOCK_K, num_stages=STAGES):
            if ROWS == 1:
                acc0 = tl.dot(y_desc.load([b * M + i0, kk * BLOCK_K]), z_desc.load([b * M + j0, kk * BLOCK_K]).T,
                              acc0)
            else:
                col = z_desc.load([b * M + j0, kk * BLOCK_K]).T
                acc0 = tl.dot(y_desc.load([b * M + i0, kk * BLOCK_K]), col, acc0)
                acc1 = tl.dot(y_desc.load([b * M + i1, kk * BLOCK_K]), col, acc1)
    _gram_epilogue_tma(acc0, b, i0, j0, c_desc, c2_desc, out_desc, s_ptr, M, alpha, beta, beta2, diag, HAS_C,
                       HAS_C2, HAS_S, HAS_D, SCALE_POW, MIRROR_DIAG, BLOCK)  # fmt: skip
    if ROWS == 2:
        if i1 <= j0:
            _gram_epilogue_tma(acc1, b, i1, j0, c_desc, c2_desc, out_desc, s_ptr, M, alpha, beta, beta2, diag,
                               HAS_C, HAS_C2, HAS_S, HAS_D, SCALE_POW, MIRROR_DIAG, BLOCK)  # fmt: skip


@triton.jit
def _axpby_kernel_tma(l_desc, r_desc, e_desc, out_desc, s_ptr, M: tl.constexpr, N: tl.constexpr, alpha,
                      HAS_S: tl.constexpr, TRANS_R: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    # l `[B*M, M]`; r's and out's storage as rows: `[B*M, N]`, or `[B*N, M]` for a tall slice's transposed view
    # (TRANS_R); e reads r's epilogue tile (another box shape), out is stored the way r is laid out.
    pid = tl.program_id(0)
    b = tl.program_id(1)
    tiles_n = N // BLOCK_N
    m0 = (pid // tiles_n) * BLOCK
    n0 = (pid % tiles_n) * BLOCK_N
    acc = tl.zeros((BLOCK, BLOCK_N), dtype=tl.float32)
    if TRANS_R:
        for kk in tl.range(0, M // BLOCK_K, num_stages=STAGES):
            acc = tl.dot(l_desc.load([b * M + m0, kk * BLOCK_K]), r_desc.load([b * N + n0, kk * BLOCK_K]).T, acc)
        acc += alpha * e_desc.load([b * N + n0, m0]).T.to(tl.float32)
        if HAS_S:
            acc = acc * tl.load(s_ptr + b)
        out_desc.store([b * N + n0, m0], acc.to(out_desc.dtype).T)
    else:
        for kk in tl.range(0, M // BLOCK_K, num_stages=STAGES):
            acc = tl.dot(l_desc.load([b * M + m0, kk * BLOCK_K]), r_desc.load([b * M + kk * BLOCK_K, n0]), acc)
        acc += alpha * e_desc.load([b * M + m0, n0]).to(tl.float32)
        if HAS_S:
            acc = acc * tl.load(s_ptr + b)
        out_desc.store([b * M + m0, n0], acc.to(out_desc.dtype))


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """A `[B, p, q]` operand's storage as a 2-D row-major matrix, and whether `t` is its transposed view:
    `([B*p, q], False)` for a contiguous `t`, `([B*q, p], True)` for the `.mT` of a contiguous tensor."""
    if t.is_contiguous():
        return t.reshape(-1, t.shape[-1]), False
    if t.mT.is_contiguous():
        return t.mT.reshape(-1, t.shape[-2]), True
    return None


def _tma_ok(*ts: torch.Tensor) -> bool:
    """Whether the TMA kernels take these operands: Hopper or later, each contiguous or a contiguous `.mT`."""
    if TensorDescriptor is None or switched_off("MOECTL_NS_TMA"):
        return False
    t0 = ts[0]
    cap = capability(t0.device)  # cached device query
    if cap is None or cap[0] < 9:
        return False
    return all(_rows(t) is not None and t.data_ptr() % 16 == 0 for t in ts)


def gram_(y: torch.Tensor, out: torch.Tensor, alpha: float = 1.0, beta: float = 0.0, c: torch.Tensor | None = None,
          scale: torch.Tensor | None = None, diag: float = 0.0, scale_power: int = 2) -> torch.Tensor:  # fmt: skip
    """`out = s^p * (alpha * y @ y.mT + beta * c + diag * I)` for `[B, m, k]` `y` (any strides) into `[B, m, m]`
    `out`, in fp32 and rounded once.

    The result is exactly symmetric. `c` must be symmetric (it is read on and above the diagonal only).
    `scale`: an fp32 `[B]` factor `s` per slice (the normalisation of a slice not yet normalised); else 1.
    `scale_power` p: 2 for a Gram of the unnormalised X, 1 for B when B's product is with it.
    """
    return symm_(y, y, out, alpha=alpha, beta=beta, c=c, scale=scale, diag=diag, scale_power=scale_power)


def symm_(y: torch.Tensor, z: torch.Tensor, out: torch.Tensor, alpha: float = 1.0, beta: float = 0.0,
          c: torch.Tensor | None = None, beta2: float = 0.0, c2: torch.Tensor | None = None,
          scale: torch.Tensor | None = None, diag: float = 0.0, scale_power: int = 2) -> torch.Tensor:  # fmt: skip
    """`out = s^p * (alpha * y @ z.mT + beta * c + beta2 * c2 + diag * I)` into `[B, m, m]` `out`, for `[B, m, k]`
    `y` and `z` laid out alike, where the product is known to be symmetric: `z` is `y` (`gram_`), or both are
    square, symmetric and commute (polynomials in one matrix, as in the Gram Newton-Schulz of `optim/muon_gram.py`;
    then `y @ z.mT = y @ z`). Only the tiles on and above the diagonal are computed, each stored with its mirror
    (a diagonal tile's upper triangle with its mirror where z is not y, whose lower one rounds another sum), so
    `out` is exactly symmetric; `c` and `c2` must be symmetric. In fp32, rounded once; `out` may have another
    dtype than the operands and must not alias them.
    """
    if scale_power not in (1, 2):
        raise ValueError(f"scale_power must be 1 or 2, got {scale_power}")
    batch, m, k = y.shape
    assert z.shape == y.shape, (tuple(y.shape), tuple(z.shape))
    cc = c if c is not None else out  # not read without HAS_C
    cc2 = c2 if c2 is not None else out  # not read without HAS_C2
    ss = scale if scale is not None else _no_scale(y.device)  # not read without HAS_S
    pairs = _upper_tiles(m // BLOCK_MN, y.device)
    flags = dict(HAS_C=c is not None, HAS_C2=c2 is not None, HAS_S=scale is not None, HAS_D=diag != 0.0,
                 SCALE_POW=scale_power, MIRROR_DIAG=z is not y, BLOCK=BLOCK_MN)  # fmt: skip
    if (out.is_contiguous() and cc.is_contiguous() and cc2.is_contiguous() and _tma_ok(y, z, cc, cc2, out)
            and _rows(y)[1] == _rows(z)[1]):  # fmt: skip
        rows = 2 if _two_row_tiles(m) else 1
        config = ("GRAM2_TMA", GRAM2_TMA_CONFIG) if rows == 2 else ("GRAM_TMA", GRAM_TMA_CONFIG)
        warps, stages, block_k = _config(*config)
        if rows == 2:
            pairs = _upper_tile_pairs(m // BLOCK_MN, y.device)
        assert out.shape == (batch, m, m) and m % BLOCK_MN == 0 and k % block_k == 0, (tuple(y.shape), tuple(out.shape))
        (y_rows, trans), (z_rows, _) = _rows(y), _rows(z)
        box = [block_k, BLOCK_MN] if trans else [BLOCK_MN, block_k]
        y_desc = TensorDescriptor.from_tensor(y_rows, box)
        out_desc = TensorDescriptor.from_tensor(out.reshape(-1, m), [BLOCK_MN, BLOCK_MN])

        def square(t: torch.Tensor) -> TensorDescriptor:  # an absent added input is `out` (never read): out's own
            return out_desc if t is out else TensorDescriptor.from_tensor(t.reshape(-1, m), [BLOCK_MN, BLOCK_MN])

        descs = (y_desc, y_desc if z is y else TensorDescriptor.from_tensor(z_rows, box), square(cc), square(cc2),
                 out_desc)  # fmt: skip
        tuning = dict(TRANS_Y=trans, ROWS=rows, BLOCK_K=block_k, STAGES=stages, num_warps=warps, num_stages=stages)
        _gram_kernel_tma[(pairs.shape[0], batch)](*descs, ss, pairs, m, k, alpha, beta, beta2, diag, **flags,
                                                  **tuning)  # fmt: skip
        return out
    warps, stages, block_k = _config("GRAM", GRAM_CONFIG)
    assert out.shape == (batch, m, m) and m % BLOCK_MN == 0 and k % block_k == 0, (tuple(y.shape), tuple(out.shape))
    _gram_kernel[(pairs.shape[0], batch)](
        y, z, cc, cc2, out, ss, pairs, k, *y.stride(), *z.stride(), *cc.stride(), *cc2.stride(), *out.stride(),
        alpha, beta, beta2, diag, **flags, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def axpby_(l: torch.Tensor, r: torch.Tensor, out: torch.Tensor, alpha: float,
           scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`out = s * (l @ r + alpha * r)` for `[B, m, m]` `l` and `[B, m, n]` `r` (any strides; `out` must not alias
    `r`); `scale`: an fp32 `[B]` factor `s` per slice, else 1."""
    batch, m, n = r.shape
    ss = scale if scale is not None else _no_scale(r.device)
    assert l.shape == (batch, m, m) and out.shape == r.shape, (tuple(l.shape), tuple(r.shape))
    if l.is_contiguous() and _tma_ok(l, r, out) and _rows(r)[1] == _rows(out)[1]:
        warps, stages, block_k, block_n = _config("AXPBY_TMA", AXPBY_TMA_CONFIG)
        assert m % BLOCK_MN == 0 and m % block_k == 0 and n % block_n == 0, (tuple(l.shape), tuple(r.shape))
        (r_rows, trans), (o_rows, _) = _rows(r), _rows(out)
        tile = [block_n, BLOCK_MN] if trans else [BLOCK_MN, block_n]
        descs = (TensorDescriptor.from_tensor(l.reshape(-1, m), [BLOCK_MN, block_k]),
                 TensorDescriptor.from_tensor(r_rows, [block_n, block_k] if trans else [block_k, block_n]),
                 TensorDescriptor.from_tensor(r_rows, tile), TensorDescriptor.from_tensor(o_rows, tile))  # fmt: skip
        tuning = dict(HAS_S=scale is not None, TRANS_R=trans, BLOCK=BLOCK_MN, BLOCK_N=block_n, BLOCK_K=block_k,
                      STAGES=stages, num_warps=warps, num_stages=stages)  # fmt: skip
        _axpby_kernel_tma[((m // BLOCK_MN) * (n // block_n), batch)](*descs, ss, m, n, alpha, **tuning)
        return out
    warps, stages, block_k, block_n = _config("AXPBY", AXPBY_CONFIG)
    assert m % BLOCK_MN == 0 and m % block_k == 0 and n % block_n == 0, (tuple(l.shape), tuple(r.shape))
    _axpby_kernel[((m // BLOCK_MN) * (n // block_n), batch)](
        l, r, out, ss, n, m, *l.stride(), *r.stride(), *out.stride(), alpha, HAS_S=scale is not None,
        BLOCK=BLOCK_MN, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@lru_cache(maxsize=None)
def _no_scale(device: torch.device) -> torch.Tensor:
    """A one-element fp32 tensor passed where a kernel's optional `scale` is absent (never read)."""
    return torch.ones(1, dtype=torch.float32, device=device)


def iterate(x: torch.Tensor, steps: int, coefficients: tuple[float, float, float], tall: bool,
            scale: torch.Tensor | None = None, bx: str | None = None) -> torch.Tensor:  # fmt: skip
    """`steps` quintic steps on `[B, rows, cols]` `x` (consumed), as `muon._iterate_fused` runs them with cuBLAS.

    A tall slice (rows > cols) runs on the transposed views. Returns a tensor of `x`'s shape and strides
    (`x` itself or its one ping-pong buffer). `scale`: fp32 `[B]`, each slice's normalisation `1 / (|X| + eps)`
    when `x` is not yet normalised: the first step's products take it in their epilogues (`X' = s X`, so
    `A = s^2 X X^T` and `X'' = s (a X + B X)`), which saves the pass over X that normalising first costs.

    `bx` (default `bx_path()`): who multiplies B into X. "cublas": B's kernel adds `a I` (and the first step's
    `s`) in its epilogue, `B' = s (a I + b A + c A A)` rounded once, and `X = B' X` is a plain cuBLAS `bmm`,
    which runs this non-symmetric product faster than the Triton kernel; "triton": `axpby_` adds `a X` in its
    epilogue instead.
    """
    a, b, c = coefficients
    bx = bx or bx_path()
    if bx not in BX_PATHS:
        raise ValueError(f"{BX_ENV}={bx!r}: expected one of {BX_PATHS}")
    cur, nxt = x, torch.empty_like(x)
    wide = (lambda t: t.mT) if tall else (lambda t: t)
    batch, m, _ = wide(x).shape
    A = torch.empty(batch, m, m, dtype=x.dtype, device=x.device)
    B = torch.empty_like(A)
    for _ in range(steps):
        gram_(wide(cur), A, scale=scale)
        # fp16 keeps the scaled first step on Triton: B' = s (a I + ...) overflows fp16 where s is large (a
        # zero slice, an expert with no tokens: s = 1e7, and inf * 0 = NaN); axpby_ scales in fp32 instead
        if bx == "cublas" and not (scale is not None and x.dtype == torch.float16):
            gram_(A, B, alpha=c, beta=b, c=A, diag=a, scale=scale, scale_power=1)
            # B' is symmetric: a tall slice's X^T <- B' X^T is X <- X B'
            torch.bmm(cur, B, out=nxt) if tall else torch.bmm(B, cur, out=nxt)
        else:
            gram_(A, B, alpha=c, beta=b, c=A)
            axpby_(B, wide(cur), wide(nxt), a, scale=scale)
        cur, nxt = nxt, cur
        scale = None
    return cur


def bx_path() -> str:
    """The default product `B X` of each step: `MOECTL_NS_BX`, else cuBLAS (faster on an H100: docs/benchmarks.md)."""
    return os.environ.get(BX_ENV, "cublas")
