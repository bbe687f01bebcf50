"""Batched transpose of 1-byte (FP8) matrices: `[..., M, K]` -> contiguous `[..., K, M]`, one launch.

Why a kernel: the columnwise copy of a per-tensor FP8 weight is its rowwise bytes transposed (same scale).
Eager torch does that as a strided element-wise copy (`x.transpose(-2, -1).contiguous()`), which for
1-byte elements reaches a small fraction of the memory bandwidth (on 2 H200s the param-gather bench
measured 3-4 ms for ~670 MB of FP8 weights, ~10x the read + write floor). Here each program moves one
`BLOCK_M x BLOCK_K` tile: it loads rows of the tile (contiguous along K), transposes it in registers /
shared memory (`tl.trans`), and stores rows of the transposed tile (contiguous along M), so both global
accesses are coalesced. Every expert of a grouped `[E, out, in]` weight is one more grid row: one launch
per weight whatever E. The bytes are moved as uint8 (a bitwise copy: no float8 arithmetic, no rounding),
so the result equals `transposed(x)` exactly for any 1-byte dtype.

`transpose_last2(x)` is the entry point: Triton for CUDA tensors when Triton imports, else the torch
fallback (`trainer.precision.blocks.transposed`). Importing this module never fails: Triton is imported
lazily (CI has none); under `TRITON_INTERPRET=1` the kernel also runs on CPU tensors (tests, small shapes).
"""

from __future__ import annotations

import functools
from typing import Any, Literal, Optional

import torch

#: (BLOCK_M, BLOCK_K, num_warps): a 64x64-byte tile (4 KB through shared memory, 32 bytes per thread: two
#: 16-byte loads and stores); `moectl bench param-gather` also times 128x128 on the GPU
DEFAULT_TILE = (64, 64, 4)

Impl = Literal["auto", "triton", "torch"]
_MAX_GRID_Y = 65535


@functools.cache
def _kernel() -> Optional[Any]:
    """The jitted kernel, or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _transpose_kernel(x_ptr, y_ptr, m_units, k_units, tiles_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                          ALIGN_M: tl.constexpr, ALIGN_K: tl.constexpr):  # fmt: skip
        # M and K arrive as multiples of their power-of-two alignments: the compiler then knows every row
        # starts ALIGN bytes apart and vectorises the global loads (rows of K) and stores (rows of M) up to
        # 16 bytes. As plain ints it assumes nothing unless a dim is divisible by 16 (fc2's K = ffn = 744 is
        # not), and moves one byte per thread and instruction.
        M = m_units * ALIGN_M
        K = k_units * ALIGN_K
        pid = tl.program_id(0)
        batch = tl.program_id(1).to(tl.int64)
        pid_m = pid // tiles_k
        pid_k = pid % tiles_k
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rk = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
        base = batch * M * K  # int64: a grouped weight may exceed 2^31 bytes
        load_mask = (rm[:, None] < M) & (rk[None, :] < K)
        tile = tl.load(x_ptr + base + rm[:, None] * K + rk[None, :], mask=load_mask, other=0)
        # the store mask is built in the output's index space: only the data tile goes through tl.trans
        store_mask = (rk[:, None] < K) & (rm[None, :] < M)
        tl.store(y_ptr + base + rk[:, None] * M + rm[None, :], tl.trans(tile), mask=store_mask)

    return _transpose_kernel


def triton_available() -> bool:
    """Whether Triton imports here (the kernel is used for CUDA tensors, or any under TRITON_INTERPRET=1)."""
    return _kernel() is not None


def transpose_triton(x: torch.Tensor, tile: tuple[int, int, int] = DEFAULT_TILE) -> torch.Tensor:
    """`x` `[..., M, K]` (1-byte elements) transposed to a new contiguous `[..., K, M]`, by the Triton kernel."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("transpose_triton needs Triton")
    if x.element_size() != 1 or x.dim() < 2:
        raise ValueError(f"transpose_triton moves 1-byte matrices, got {x.dtype} of shape {tuple(x.shape)}")
    *lead, M, K = x.shape
    src = x.contiguous().view(torch.uint8)
    out = torch.empty((*lead, K, M), dtype=torch.uint8, device=x.device)
    batch = src.numel() // max(M * K, 1)
    if out.numel() == 0:
        return out.view(x.dtype)
    block_m, block_k, warps = tile
    tiles_k = -(-K // block_k)
    align_m, align_k = _alignment(M), _alignment(K)
    src3, out3 = src.view(batch, M, K), out.view(batch, K, M)
    for b0 in range(0, batch, _MAX_GRID_Y):  # CUDA caps the grid's y dimension; more matrices: more launches
        b1 = min(batch, b0 + _MAX_GRID_Y)
        grid = (-(-M // block_m) * tiles_k, b1 - b0)
        kernel[grid](src3[b0:b1], out3[b0:b1], M // align_m, K // align_k, tiles_k, BLOCK_M=block_m,
                     BLOCK_K=block_k, ALIGN_M=align_m, ALIGN_K=align_k, num_warps=warps)  # fmt: skip
    return out.view(x.dtype)


def _alignment(n: int) -> int:
    """The largest power of two up to 16 dividing `n` (bytes per vector the kernel may move along a row)."""
    a = 16
    while n % a:
        a //= 2
    return a


def transpose_torch(x: torch.Tensor) -> torch.Tensor:
    """The torch fallback (and the reference): the eager strided copy, in standard contiguous strides (also
    for size-1 dims, which `.contiguous()` would leave strided and which then cannot be viewed as bytes)."""
    return x.transpose(-2, -1).clone(memory_format=torch.contiguous_format)


def transpose_last2(x: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """`x` `[..., M, K]` transposed to a new contiguous `[..., K, M]`, bitwise.

    impl: "auto" (Triton for CUDA tensors of 1-byte elements where Triton imports, else torch), or force one.
    """
    if impl == "torch":
        return transpose_torch(x)
    if impl == "triton" or (x.is_cuda and x.element_size() == 1 and x.dim() >= 2 and triton_available()):
        return transpose_triton(x)
    return transpose_torch(x)
