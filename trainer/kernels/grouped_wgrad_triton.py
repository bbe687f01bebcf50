"""Grouped weight-grad GEMM that accumulates into fp32 `main_grad` (Triton, CUDA): gradient-accumulation
fusion for the experts.

    c[e] += a[rows of e]^T @ b[rows of e]      a `[T, M]`, b `[T, N]` bf16; c[e] `[M, N]` fp32

`torch._grouped_mm` cannot write fp32 from bf16 operands nor add into its output, so the unfused expert
wgrad writes a bf16 `[E, M, N]` grad that is then added into the fp32 buffer: on the reference model that
add was 30 ms of a 348 ms step (H100). Here each program owns one `[BLOCK_M, BLOCK_N]` tile of one expert,
sums that expert's rows in fp32 registers, and adds the tile into `c` once: the products are never rounded
to bf16, and the grad is read and written once, by the epilogue.

`c` is any set of E fp32 `[M, N]` matrices inside one allocation (a grouped param's `[E, M, N]` main_grad,
or the per-expert params' main_grads in the grad buffer): `c_offs_E` gives each one's element offset from
`c`'s data pointer, so both expert layouts run the same kernel on the same values.
The pure-torch definition (the CPU path and the tests' reference) is `grouped_wgrad.py`, which also picks
between the two.

Two kernels, the same sums in the same order (bitwise equal, measured):
- `_wgrad_kernel_tma` (Hopper and later): A and B tiles of full `BLOCK_K`-row blocks arrive by TMA, and the
  fp32 tile of `c` is read and written by TMA too. With pointer tensors, the epilogue's 64-bit addresses of a
  128x128 fp32 tile held the kernel at 255 registers, one CTA per SM, and the read-modify-write of `c` did
  not overlap the next tile's GEMM: 300 TFLOP/s on an H100 at the reference shapes; with TMA 100-165
  registers and 390-400 TFLOP/s (docs/benchmarks.md). It needs the E matrices of `c` to be rows of one
  `[R, N]` fp32 matrix (every offset a whole number of rows) and `M % BLOCK_M == 0`, so a tile never spans
  two experts; the caller checks (`grouped_wgrad.py`).
- `_wgrad_kernel`: pointer loads everywhere, any layout, any GPU Triton runs on.

Sums of squares (`sq_ptr`, on the step's last accumulation; `trainer/grad_sq.py`): each program also writes
the sum of squares of its final fp32 tile, which it holds in registers anyway, to its own slot (no atomics:
the same bits every run). The grad norm then adds those partials instead of reading the expert grads
again: on the reference model those grads are 88% of the bytes the norm reads.

Stale targets (`stale_ptr`, `stale_offs_E`): expert e's target may be flagged stale (an int32 at
`stale_ptr + stale_offs_E[e]`, nonzero after `zero_grad` skipped zero-filling it, `trainer/main_grad.py`):
its tile is then stored, not added (an expert without rows stores zeros), which is bitwise the zero fill plus
the add, without the fill's write and the add's read of `c`. Programs only read the flags; the caller clears
them after the launch (a program clearing its own flag would race the expert's other tiles).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from trainer.kernels import capability

try:  # Triton >= 3.3: host-side TMA descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer kernel only
    TensorDescriptor = None

# Chosen by scripts/probes/grouped_wgrad.py on an H100 at the reference shapes (docs/benchmarks.md).
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 128, 128, 64, 8, 3
TMA_BLOCK_M, TMA_BLOCK_N, TMA_BLOCK_K, TMA_NUM_WARPS, TMA_NUM_STAGES = 128, 128, 32, 4, 4


@triton.jit
def _wgrad_kernel(
    a_ptr, b_ptr, c_ptr, offs_ptr, c_offs_ptr, stale_ptr, stale_offs_ptr, sq_ptr,
    M, N, stride_at, stride_bt, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_STALE: tl.constexpr,
    HAS_SQ: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    pid_m, pid_n = pid // tiles_n, pid % tiles_n
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    end = tl.load(offs_ptr + e).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(start, end, BLOCK_K):
        rows = k + rk
        row_ok = rows < end
        # a^T tile [BLOCK_M, BLOCK_K]: element (m, r) is a[r, m]; m is contiguous in memory
        a = tl.load(a_ptr + rows[None, :] * stride_at + rm[:, None], mask=row_ok[None, :] & (rm[:, None] < M), other=0.0)
        b = tl.load(b_ptr + rows[:, None] * stride_bt + rn[None, :], mask=row_ok[:, None] & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    stale = False
    if HAS_STALE:
        stale = tl.load(stale_ptr + tl.load(stale_offs_ptr + e)) != 0
    c_base = c_ptr + tl.load(c_offs_ptr + e)
    c_ptrs = c_base + rm[:, None] * stride_cm + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if stale:  # leftovers read as zero: store the sum (zeros for an expert without rows)
        tl.store(c_ptrs, acc, mask=mask)
    elif end > start:  # an expert without rows leaves its grad untouched
        acc = tl.load(c_ptrs, mask=mask, other=0.0) + acc
        tl.store(c_ptrs, acc, mask=mask)
    elif HAS_SQ:  # untouched, but its square still counts
        acc = tl.load(c_ptrs, mask=mask, other=0.0)
    if HAS_SQ:  # masked lanes hold 0 (acc's rows beyond M summed nothing, or were loaded as 0)
        tl.store(sq_ptr + e * tl.num_programs(0) + pid, tl.sum(tl.sum(acc * acc, axis=1), axis=0))


def grouped_wgrad_accumulate_(c: torch.Tensor, c_offs_E: torch.Tensor, a_TM: torch.Tensor, b_TN: torch.Tensor,
                              offs_E: torch.Tensor, M: int, N: int,
                              config: tuple[int, int, int, int, int] | None = None,
                              stale: tuple[torch.Tensor, torch.Tensor] | None = None,
                              sq: torch.Tensor | None = None) -> None:
    """c[e] += a[rows of e]^T b[rows of e] for every expert e, in fp32, in one launch (`config`: the tile
    shape, warps and stages to use instead of the chosen ones; for the tuning probe).

    `offs_E`: int32/int64 cumulative row ends per expert (on the device); `c_offs_E`: int64 element offset of
    expert e's `[M, N]` fp32 matrix (row stride N) from `c.data_ptr()`. a and b contiguous, one dtype.
    `stale`: (int32 flags, int64 offset of expert e's flag from the flags' data pointer): a flagged target is
    overwritten (see the module docstring); the flags are left as they were. `sq`: fp32, `sq_slots(E, M, N)`
    elements: each tile's sum of squares of its final `c` goes there (module docstring).
    """
    if a_TM.shape[1] != M or b_TN.shape[1] != N or a_TM.shape[0] != b_TN.shape[0]:
        raise ValueError(f"operands {tuple(a_TM.shape)} and {tuple(b_TN.shape)} do not make [{M}, {N}] grads")
    if c.dtype != torch.float32 or not (a_TM.is_contiguous() and b_TN.is_contiguous()):
        raise ValueError("grouped wgrad accumulation takes contiguous operands and an fp32 target")
    bm, bn, bk, warps, stages = config or (BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), offs_E.numel())
    flags, flag_offs_E = stale if stale is not None else (offs_E, offs_E)  # unread without HAS_STALE
    _check_sq(sq, grid)
    _wgrad_kernel[grid](
        a_TM, b_TN, c, offs_E, c_offs_E, flags, flag_offs_E, c if sq is None else sq, M, N,
        a_TM.stride(0), b_TN.stride(0), N,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_STALE=stale is not None, HAS_SQ=sq is not None,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


@triton.jit
def _source_dot(acc, a_desc, b_desc, a_ptr, b_ptr, offs_ptr, e, m0, n0, M, N, stride_at, stride_bt,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """acc += a[rows of e]^T b[rows of e] for one source; and whether e has rows there."""
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int32)
    end = tl.load(offs_ptr + e).to(tl.int32)
    # full blocks by TMA: a block's rows all belong to expert e (a TMA box is clipped only at the tensor's edge)
    for i in tl.range(0, (end - start) // BLOCK_K, num_stages=STAGES):
        r = start + i * BLOCK_K
        acc = tl.dot(a_desc.load([r, m0]).T, b_desc.load([r, n0]), acc)
    # the partial last block by masked loads (rows of the next expert read as 0); the same order of sums
    rk = tl.arange(0, BLOCK_K)
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    rows = (start + (end - start) // BLOCK_K * BLOCK_K + rk).to(tl.int64)
    row_ok = rows < end
    a = tl.load(a_ptr + rows[:, None] * stride_at + rm[None, :], mask=row_ok[:, None] & (rm[None, :] < M), other=0.0)
    b = tl.load(b_ptr + rows[:, None] * stride_bt + rn[None, :], mask=row_ok[:, None] & (rn[None, :] < N), other=0.0)
    acc = tl.dot(a.T, b, acc)
    return acc, end > start


@triton.jit
def _wgrad_kernel_tma(
    a_desc0, b_desc0, a_ptr0, b_ptr0, offs_ptr0, a_desc1, b_desc1, a_ptr1, b_ptr1, offs_ptr1,
    a_desc2, b_desc2, a_ptr2, b_ptr2, offs_ptr2, a_desc3, b_desc3, a_ptr3, b_ptr3, offs_ptr3,
    c_desc, c_row_ptr, stale_ptr, stale_offs_ptr, sq_ptr,
    M, N, stride_at, stride_bt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    HAS_STALE: tl.constexpr, HAS_SQ: tl.constexpr, SOURCES: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    pid_m, pid_n = pid // tiles_n, pid % tiles_n
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the sources' rows of expert e summed in one fp32 accumulator, source by source (deferred micro-batches)
    acc, rows = _source_dot(acc, a_desc0, b_desc0, a_ptr0, b_ptr0, offs_ptr0, e, m0, n0, M, N, stride_at, stride_bt,
                            BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
    if SOURCES > 1:
        acc, more = _source_dot(acc, a_desc1, b_desc1, a_ptr1, b_ptr1, offs_ptr1, e, m0, n0, M, N, stride_at,
                                stride_bt, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
        rows = rows | more
    if SOURCES > 2:
        acc, more = _source_dot(acc, a_desc2, b_desc2, a_ptr2, b_ptr2, offs_ptr2, e, m0, n0, M, N, stride_at,
                                stride_bt, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
        rows = rows | more
    if SOURCES > 3:
        acc, more = _source_dot(acc, a_desc3, b_desc3, a_ptr3, b_ptr3, offs_ptr3, e, m0, n0, M, N, stride_at,
                                stride_bt, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
        rows = rows | more
    stale = False
    if HAS_STALE:
        stale = tl.load(stale_ptr + tl.load(stale_offs_ptr + e)) != 0
    row = tl.load(c_row_ptr + e).to(tl.int32) + m0
    if stale:  # leftovers read as zero: store the sum (zeros for an expert without rows)
        c_desc.store([row, n0], acc)
    elif rows:  # an expert without rows leaves its grad untouched
        acc = c_desc.load([row, n0]) + acc
        c_desc.store([row, n0], acc)
    elif HAS_SQ:  # untouched, but its square still counts
        acc = c_desc.load([row, n0])
    if HAS_SQ:  # a TMA tile lies inside c's N columns (it clips there); M % BLOCK_M == 0
        tl.store(sq_ptr + e * tl.num_programs(0) + pid, tl.sum(tl.sum(acc * acc, axis=1), axis=0))


def tma_supported(device: torch.device) -> bool:
    """Whether `grouped_wgrad_accumulate_tma_` can run on `device` (TMA: compute capability 9.0 or later)."""
    cap = capability(device)  # cached: asked on every wgrad, fp8 grouped GEMM and fp8 wgrad call
    return TensorDescriptor is not None and cap is not None and cap[0] >= 9


#: the most sources (deferred micro-batches' operands) one TMA launch sums; more take several launches
MAX_SOURCES = 4


def grouped_wgrad_accumulate_tma_(c_RN: torch.Tensor, c_row_E: torch.Tensor, a_TM: torch.Tensor, b_TN: torch.Tensor,
                                  offs_E: torch.Tensor, M: int, N: int,
                                  config: tuple[int, int, int, int, int] | None = None,
                                  stale: tuple[torch.Tensor, torch.Tensor] | None = None,
                                  sq: torch.Tensor | None = None,
                                  more: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = ()) -> None:
    """c[e] += a[rows of e]^T b[rows of e] with TMA loads and stores: `c_RN` is an fp32 `[R, N]` matrix whose rows
    `c_row_E[e] .. c_row_E[e] + M` (int64, on the device) are expert e's grad. Needs `M % BLOCK_M == 0`, a and
    b contiguous with 16-byte aligned rows (`M % 8 == N % 8 == 0` in bf16) and `tma_supported`. `stale` and
    `sq` as for `grouped_wgrad_accumulate_`. `more`: up to `MAX_SOURCES - 1` further `(a, b, offs)` whose
    products are summed into the same fp32 accumulator after (a, b)'s, so c is read and written once for all."""
    bm, bn, bk, warps, stages = config or (TMA_BLOCK_M, TMA_BLOCK_N, TMA_BLOCK_K, TMA_NUM_WARPS, TMA_NUM_STAGES)
    sources = [(a_TM, b_TN, offs_E), *more]
    if len(sources) > MAX_SOURCES:
        raise ValueError(f"at most {MAX_SOURCES} sources per launch, got {len(sources)}")
    args: list[object] = []
    for a, b, offs in sources:
        if M % bm or a.shape[1] != M or b.shape[1] != N or a.shape[0] != b.shape[0] or offs.numel() != offs_E.numel():
            raise ValueError(f"operands {tuple(a.shape)}, {tuple(b.shape)} and M={M} (a multiple of {bm}) disagree")
        if a.stride() != (M, 1) or b.stride() != (N, 1):
            raise ValueError("TMA wgrad sources must be contiguous")
        args += [TensorDescriptor.from_tensor(a, [bk, bm]), TensorDescriptor.from_tensor(b, [bk, bn]), a, b, offs]
    args += args[:5] * (MAX_SOURCES - len(sources))  # unread (SOURCES)
    c_desc = TensorDescriptor.from_tensor(c_RN, [bm, bn])
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), offs_E.numel())
    flags, flag_offs_E = stale if stale is not None else (offs_E, offs_E)  # unread without HAS_STALE
    _check_sq(sq, grid)
    _wgrad_kernel_tma[grid](
        *args, c_desc, c_row_E, flags, flag_offs_E, c_RN if sq is None else sq, M, N, M, N,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, HAS_STALE=stale is not None, HAS_SQ=sq is not None,
        SOURCES=len(sources), num_warps=warps, num_stages=stages,
    )  # fmt: skip


def sq_slots(E: int, M: int, N: int) -> int:
    """How many fp32 partial sums of squares a launch with `sq` writes: one per tile (both kernels' default
    tiles are BLOCK_M x BLOCK_N)."""
    assert (BLOCK_M, BLOCK_N) == (TMA_BLOCK_M, TMA_BLOCK_N)
    return E * triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)


def _check_sq(sq: torch.Tensor | None, grid: tuple[int, int]) -> None:
    if sq is not None and (sq.dtype != torch.float32 or sq.numel() != grid[0] * grid[1] or not sq.is_contiguous()):
        raise ValueError(f"sq must be a contiguous fp32 tensor of {grid[0] * grid[1]} elements, got {tuple(sq.shape)}")
