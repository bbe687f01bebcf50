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
into the grad tile, itself read and written by TMA. The product is never rounded to bf16.

Layouts as `grouped_wgrad_triton._wgrad_kernel_tma`: `c` is an fp32 `[R, N]` matrix whose rows
`c_row_E[e] ..` are expert e's grad, `M % BLOCK_M == 0` so a tile never spans two experts. A group's
columns that do not fill a whole `BLOCK_K` block are read by masked pointer loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainer.kernels.grouped_wgrad_triton import TensorDescriptor, tma_supported

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the fastest of six on an H100 at the reference model's
# expert shapes, in both accumulation modes (docs/benchmarks.md, twelfth session)
CONFIG = (256, 128, 128, 8, 3)
CONFIG_128 = (128, 128, 128, 8, 3)  # grads whose rows are not whole 256-row tiles (10-15% slower there)
PRECISE = 128  # products per fp32 promotion in precise mode (CUTLASS's interval: 4 wgmma k-steps of 32)


@triton.jit
def _fp8_wgrad_kernel_tma(
    a_desc, b_desc, c_desc, a_ptr, b_ptr, offs_ptr, c_row_ptr, sa_ptr, sb_ptr,
    M, N, T,
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in tl.range(0, (end - start) // BLOCK_K, num_stages=STAGES):
        k = start + i * BLOCK_K
        acc = tl.dot(a_desc.load([m0, k]), b_desc.load([n0, k]).T, acc, max_num_imprecise_acc=IMPRECISE)
    # the group's last partial block (columns of the next group read as 0)
    cols = (start + (end - start) // BLOCK_K * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    col_ok = cols < end
    rm = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    a = tl.load(a_ptr + rm[:, None] * T + cols[None, :], mask=col_ok[None, :], other=0.0)
    b = tl.load(b_ptr + rn[:, None] * T + cols[None, :], mask=col_ok[None, :] & (rn[:, None] < N), other=0.0)
    acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=IMPRECISE)
    if end > start:  # an expert without rows leaves its grad untouched
        scale = tl.load(sa_ptr + e) * tl.load(sb_ptr + e)
        row = tl.load(c_row_ptr + e).to(tl.int32) + m0
        c_desc.store([row, n0], c_desc.load([row, n0]) + acc * scale)


def fits(a_MT: torch.Tensor, b_NT: torch.Tensor, M: int) -> bool:
    """Whether the kernel takes these operands: TMA on this device, fp8 operands with 16-byte aligned rows and
    bases, and whole `BLOCK_M`-row tiles of each expert's grad."""
    return (
        TensorDescriptor is not None
        and tma_supported(a_MT.device)
        and a_MT.element_size() == b_NT.element_size() == 1
        and a_MT.is_floating_point() and b_NT.is_floating_point()
        and a_MT.is_contiguous() and b_NT.is_contiguous()
        and M % CONFIG_128[0] == 0
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
    bm, bn, bk, warps, stages = config or (CONFIG if M % CONFIG[0] == 0 else CONFIG_128)
    N = b_NT.shape[0]
    if M % bm or b_NT.shape[1] != T or c_RN.dtype != torch.float32:
        raise ValueError(f"operands {tuple(a_MT.shape)}, {tuple(b_NT.shape)} do not make [{M}, {N}] fp32 grads")
    a_desc = TensorDescriptor.from_tensor(a_MT, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b_NT, [bn, bk])
    c_desc = TensorDescriptor.from_tensor(c_RN, [bm, bn])
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), offs_E.numel())
    _fp8_wgrad_kernel_tma[grid](
        a_desc, b_desc, c_desc, a_MT, b_NT, offs_E, c_row_E, scale_a_E, scale_b_E, M, N, T,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, IMPRECISE=None if fast_accum else min(PRECISE, bk),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
