"""Grouped fp8 GEMM with precise accumulation for jagged rows times per-expert weights (Triton, Hopper and
later): the experts' data grad under a per-tensor fp8 recipe, and under `fp8: hybrid` (e5m2 grads times
e4m3 weights, which torch's grouped kernel does not take) in either accumulation mode.

    out[rows of e] = (sa[e] * sb[e]) * a[rows of e] @ b[e]^T      a `[T, K]`, b `[E, N, K]` fp8; out `[T, N]` bf16

`torch._scaled_grouped_mm` with precise (split) accumulation, the default for backward GEMMs, ran the
reference model's fc2 data grad (N 1024, K 2048) at 303 TFLOP/s and the fine-grained model's at about the
same, where its fast-accumulating kernel ran 971 (docs/benchmarks.md, twelfth session): the precise kernels
it picks are a poor fit there. Here the fp8 products are summed in fp32 registers, promoted out of the
tensor cores' accumulator every `PRECISE` products (CUTLASS's interval), so the numerics are the precise
kernel's and the speed is close to the fast one's.

Each program owns one `[BLOCK_M, BLOCK_N]` output tile of one group: the grid walks the groups' row tiles
(a group of n rows has ceil(n / BLOCK_M) of them; the group of a tile is found from the device offsets, no
host sync), so a tile never spans two experts. A tile's operand rows arrive by TMA even past its group's
end (the next group's rows, read and not stored); its output rows are stored masked to the group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainer.kernels.grouped_wgrad_triton import TensorDescriptor, tma_supported

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the fastest of seven tiles on an H100 at the reference and
# fine-grained models' data grads (docs/benchmarks.md, twelfth session), then stages (thirteenth: 4 ran
# 1.06-1.13x 3; 5 would not fit shared memory). The second, for N not a multiple of 256: 6 stages ran
# 1.14-1.20x 3 with this tile, measured at those same shapes.
CONFIG = (128, 256, 128, 8, 4)
CONFIG_128 = (128, 128, 128, 8, 6)
PRECISE = 128  # products per fp32 promotion (CUTLASS's precise interval: 4 wgmma k-steps of 32)
# torch's precise kernel is the faster one from here: at N = K = 2048 it ran 790 TFLOP/s against this
# kernel's 694 (740 with 4 stages, thirteenth session), where at min(N, K) <= 1536 this one ran 2.2-2.9x faster
TORCH_FROM = 2048


def preferred(N: int, K: int) -> bool:
    """Whether this kernel is the faster precise one for output width N and contraction K (measured)."""
    return min(N, K) < TORCH_FROM


@triton.jit
def _fp8_grouped_mm_kernel(
    a_desc, b_desc, out_ptr, offs_ptr, sa_ptr, sb_ptr,
    N, K, E,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    E_POW2: tl.constexpr, IMPRECISE: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    # the group of this row tile: groups laid out tile after tile, ceil(rows / BLOCK_M) tiles each
    g = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + g, mask=g < E, other=0).to(tl.int32)
    starts = tl.load(offs_ptr + g - 1, mask=(g > 0) & (g < E), other=0).to(tl.int32)
    tiles = tl.where(g < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    first_tile = tl.cumsum(tiles, 0) - tiles
    mine = (tile >= first_tile) & (tile < first_tile + tiles)
    if tl.sum(mine.to(tl.int32), 0) == 0:  # past the last group's tiles (the grid is an upper bound)
        return
    e = tl.sum(tl.where(mine, g, 0), 0)
    end = tl.sum(tl.where(mine, ends, 0), 0)
    row0 = tl.sum(tl.where(mine, starts + (tile - first_tile) * BLOCK_M, 0), 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        a = a_desc.load([row0, k])
        b = b_desc.load([e * N + n0, k])
        acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=IMPRECISE)
    scale = tl.load(sa_ptr + e) * tl.load(sb_ptr + e)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(ptrs, (acc * scale).to(out_ptr.dtype.element_ty), mask=(rows[:, None] < end) & (cols[None, :] < N))


def fits(a_TK: torch.Tensor, b_ENK: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: TMA on this device, contiguous fp8 (e4m3 or e5m2, not both
    e5m2) with 16-byte aligned bases, and N and K whole tiles (a weight tile never spans two experts, a K step
    never runs short)."""
    _, bn, bk, _, _ = CONFIG_128
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    return (
        TensorDescriptor is not None
        and tma_supported(a_TK.device)
        and a_TK.dtype in fp8 and b_ENK.dtype in fp8 and not a_TK.dtype == b_ENK.dtype == torch.float8_e5m2
        and a_TK.is_contiguous() and b_ENK.is_contiguous()
        and b_ENK.shape[1] % bn == 0 and b_ENK.shape[2] % bk == 0
        and a_TK.data_ptr() % 16 == 0 and b_ENK.data_ptr() % 16 == 0
    )  # fmt: skip


def fp8_grouped_mm(
    a_TK: torch.Tensor, b_ENK: torch.Tensor, offs_E: torch.Tensor, scale_a_E: torch.Tensor, scale_b_E: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16, config: tuple[int, int, int, int, int] | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`[T, N]`: rows of group e times b[e]^T, scaled by scale_a[e] * scale_b[e], precise accumulation unless
    `fast_accum` (check `fits` first). `offs_E`: cumulative row ends (device, ending at T); scales fp32 `[E]`. Rows past the
    last group are left as allocated. `config` overrides `CONFIG` (the tuning probe)."""
    T, K = a_TK.shape
    E, N, _ = b_ENK.shape
    bm, bn, bk, warps, stages = config or (CONFIG if N % CONFIG[1] == 0 else CONFIG_128)
    out = torch.empty(T, N, dtype=out_dtype, device=a_TK.device)
    a_desc = TensorDescriptor.from_tensor(a_TK, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b_ENK.view(E * N, K), [bn, bk])
    grid = (triton.cdiv(T, bm) + E, triton.cdiv(N, bn))  # row tiles: at most one partial tile per group
    _fp8_grouped_mm_kernel[grid](
        a_desc, b_desc, out, offs_E, scale_a_E, scale_b_E, N, K, E,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, E_POW2=triton.next_power_of_2(E),
        IMPRECISE=None if fast_accum else min(PRECISE, bk), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
