"""Grouped fp8 weight-grad GEMM that accumulates into fp32 `main_grad` (Triton, Hopper and later): gradient-
accumulation fusion for experts under a per-tensor fp8 recipe.

    c[e] += (sa[e] * sb[e]) * a[:, cols of e] @ b[:, cols of e]^T     a `[M, T]`, b `[N, T]` fp8; c[e] `[M, N]` fp32

a and b are the columnwise copies of the quantized output grad and input (token-major groups become column
groups), sa and sb their per-group decode scales. `torch._scaled_grouped_mm` returns this product in bf16,
which the trainer then added into the fp32 `main_grad`: on the reference model, an H100, the add was 27.7 ms
of the fp8 step, and the kernel's precise mode ran fc2's shape at 255 TFLOP/s (docs/benchmarks.md, twelfth
session). Here each program owns one `[BLOCK_M, BLOCK_N]` tile of one expert: the operands arrive by TMA,
the fp8 products are summed in fp32 (promoted out of the tensor cores' accumulator every `PRECISE` products
unless fast accumulation is asked for, as CUTLASS's precise kernels do every 128), scaled once, and added
into the grad tile. The product is never rounded to bf16.

Layouts as `grouped_wgrad_triton._wgrad_kernel_tma`: `c` is an fp32 `[R, N]` matrix whose rows
`c_row_E[e] ..` are expert e's grad, `M % BLOCK_M == 0` so a tile never spans two experts. Each program
builds TMA descriptors of its group's columns on the device (Triton's `make_tensor_descriptor`; its memory
from `_scratch`), so a group's columns that do not fill a whole `BLOCK_K` block arrive zero-padded. Every group
boundary must be a multiple of 16 columns: the per-tensor fp8 recipes pad each expert to 16 rows
(`Recipe.align_size`, the dispatcher's contract), which `_scaled_grouped_mm` needs as well. Needs Triton 3.5+.
The grad tile is read and written by pointer (a TMA epilogue's fp32 staging buffer would leave one program
per SM, and the read-modify-write would not overlap any GEMM).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
import triton
import triton.language as tl

from trainer.kernels.grouped_wgrad_triton import TensorDescriptor, tma_supported

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the fastest of 11 on an H100 at the reference and
# fine-grained models' expert shapes (docs/benchmarks.md, thirteenth session). One warpgroup and 96 KiB of
# shared memory per program let two programs share an SM, so one's read-modify-write of `c` runs under the
# other's GEMM: 1.17-1.23x the one-program-per-SM (256, 128, 128, 8, 4) with a TMA epilogue where groups are
# whole 128-column blocks; this kernel, with partial blocks, 1.05-1.08x it at the reference shapes (skewed).
CONFIG = (128, 128, 128, 4, 3)
PRECISE = 128  # products per fp32 promotion in precise mode (CUTLASS's interval: 4 wgmma k-steps of 32)


@triton.jit
def _fp8_wgrad_kernel_tma(
    a_ptr, b_ptr, c_ptr, offs_ptr, c_row_ptr, sa_ptr, sb_ptr,
    M, N, T, stride_c,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    IMPRECISE: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    m0 = pid // tiles_n * BLOCK_M
    n0 = pid % tiles_n * BLOCK_N
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int32)
    end = tl.load(offs_ptr + e).to(tl.int32)
    if end <= start:  # an expert without rows leaves its grad untouched
        return
    # descriptors of this group's columns only: TMA zero-fills a box past the group's last column, so the
    # partial last block needs no masking (masked operands took shared memory of their own, and with it the
    # second program per SM). Group boundaries must be multiples of 16 columns (a descriptor's base is 16-byte
    # aligned; groups starting elsewhere hit an illegal instruction on an H100, measured)
    a_desc = tl.make_tensor_descriptor(a_ptr + start, shape=[M, end - start], strides=[T, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr + start, shape=[N, end - start], strides=[T, 1], block_shape=[BLOCK_N, BLOCK_K])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in tl.range(0, tl.cdiv(end - start, BLOCK_K), num_stages=STAGES):
        k = i * BLOCK_K
        acc = tl.dot(a_desc.load([m0, k]), b_desc.load([n0, k]).T, acc, max_num_imprecise_acc=IMPRECISE)
    scale = tl.load(sa_ptr + e) * tl.load(sb_ptr + e)
    # the tile's own base address, then 32-bit offsets inside it: 64-bit addresses for every element held the
    # kernel at 255 registers
    row = tl.load(c_row_ptr + e) + m0
    tile = c_ptr + row * stride_c + n0
    offs = tl.arange(0, BLOCK_M)[:, None] * stride_c + tl.arange(0, BLOCK_N)[None, :]
    col_in = (n0 + tl.arange(0, BLOCK_N)) < N
    tl.store(tile + offs, tl.load(tile + offs, mask=col_in[None, :]) + acc * scale, mask=col_in[None, :])


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the kernel's device-side TMA descriptors (Triton asks its allocator at launch; a
    CUDA graph capture takes it from the graph's pool)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _device_descriptors() -> bool:
    """Whether this Triton builds TMA descriptors inside kernels with a per-launch allocator (`tl.
    make_tensor_descriptor`, the allocator a context variable: Triton 3.5 and later)."""
    try:
        from triton.runtime._allocation import _allocator
    except ImportError:
        return False
    return hasattr(tl, "make_tensor_descriptor") and isinstance(_allocator, contextvars.ContextVar)


_DEVICE_DESCRIPTORS = _device_descriptors()


@contextlib.contextmanager
def _descriptor_memory() -> Iterator[None]:
    """`_scratch` as Triton's allocator for one launch (this thread's context only), the caller's own
    allocator back afterwards."""
    from triton.runtime._allocation import _allocator

    token = _allocator.set(_scratch)
    try:
        yield
    finally:
        _allocator.reset(token)


def fits(a_MT: torch.Tensor, b_NT: torch.Tensor, M: int) -> bool:
    """Whether the kernel takes these operands: TMA on this device and device-side descriptors in this Triton,
    fp8 operands with 16-byte aligned rows and bases, and whole `BLOCK_M`-row tiles of each expert's grad.
    Group boundaries (multiples of 16) are the caller's contract, not checked here: that would be a host sync."""
    return (
        TensorDescriptor is not None
        and _DEVICE_DESCRIPTORS
        and tma_supported(a_MT.device)
        and a_MT.element_size() == b_NT.element_size() == 1
        and a_MT.is_floating_point() and b_NT.is_floating_point()
        and a_MT.is_contiguous() and b_NT.is_contiguous()
        and M % CONFIG[0] == 0
        and a_MT.shape[1] % 16 == 0
        and a_MT.data_ptr() % 16 == 0 and b_NT.data_ptr() % 16 == 0
    )  # fmt: skip


def fp8_grouped_wgrad_accumulate_tma_(
    c_RN: torch.Tensor, c_row_E: torch.Tensor, a_MT: torch.Tensor, b_NT: torch.Tensor, offs_E: torch.Tensor,
    scale_a_E: torch.Tensor, scale_b_E: torch.Tensor, *, fast_accum: bool = False,
    config: tuple[int, int, int, int, int] | None = None,
) -> None:  # fmt: skip
    """c[e] += scale_a[e] scale_b[e] a[:, cols of e] b[:, cols of e]^T for every group e, one launch (check
    `fits` first). `offs_E`: cumulative column ends (device); `c_row_E`: int64 first row of each expert's
    grad in `c_RN`; scales fp32 `[E]`. `config` overrides `CONFIG` (the tuning probe)."""
    M, T = a_MT.shape
    bm, bn, bk, warps, stages = config or CONFIG
    N = b_NT.shape[0]
    if M % bm or b_NT.shape[1] != T or c_RN.dtype != torch.float32 or c_RN.stride(1) != 1:
        raise ValueError(
            f"operands {tuple(a_MT.shape)}, {tuple(b_NT.shape)} do not make [{M}, {N}] fp32 grads into a "
            f"{c_RN.dtype} target with strides {c_RN.stride()} (fp32, rows contiguous)"
        )
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), offs_E.numel())
    with _descriptor_memory():
        _fp8_wgrad_kernel_tma[grid](
            a_MT, b_NT, c_RN, offs_E, c_row_E, scale_a_E, scale_b_E, M, N, T, c_RN.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, IMPRECISE=None if fast_accum else min(PRECISE, bk),
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
