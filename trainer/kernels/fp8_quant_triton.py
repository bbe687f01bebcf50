"""Fused per-tensor FP8 quantization on CUDA (Triton): amax, scales, one-pass rowwise + columnwise cast,
and the zeroing of empty experts' weight grads.

The reference is trainer/precision's eager per-tensor path, and this module computes exactly the same
values, byte for byte (kinds/per_tensor.py, fp8_scale.py, formats.cast_to_fp8):

    amax    = max |x|                  per leading index b of x_BMK (one per expert of a grouped weight), or
                                       per token group of a jagged x_TK (rows carry group ids; empty group: 0);
                                       NaN propagates
    encode  = fp8_scale.scale_from_amax(amax, fmax, pow2)      (or given: delayed scaling)
    decode  = 1 / encode                                        (what is stored with the data)
    data    = cast_to_fp8(fp32(x) * encode[b or group])         clamp to +-fmax keeping NaN, RNE cast

Legend: B leading (batch) index, M rows, K columns (the contraction dim of the rowwise copy), T token rows,
G token groups, E experts, O/D a weight grad's out/in dims.

Kernels, and the bytes each moves per element of x (2 for bf16 input, 4 for fp32):
- `_amax_kernel`: reads x once in its own dtype (2 B/elem for bf16), max of |x| as int32 bit patterns per
  tile (|x| is non-negative, so integer order is float order, and a NaN, whose bits exceed +inf's, wins:
  NaN propagates without a separate flag), then one int32 `atomic_max` per tile (per row where a tile
  spans two token groups). The result is exact: max is order-independent, so atomics are deterministic.
- `_quantize_kernel`: the scale rule first, on its rows' amax (or given encode scales): each tile computes the
  scale of its rows' slots itself (correctly rounded divisions, `div_rn`, as torch's CUDA division), and the
  first tiles also write the slots' encode / decode scales and, for a token-grouped tensor, the decode scales
  expanded as the native grouped GEMMs read them (per row, and group-major per column). A separate scales
  launch, and the eager ops that expanded its output, cost more host time than the divisions cost the tiles.
  Then one pass, reads x once (2 B/elem) and writes the rowwise copy `[B, M, K]` (1 B/elem)
  and/or the columnwise copy `[B, K, M]` (1 B/elem): the tile is cast once and transposed in registers
  (`tl.trans`), so both stores are contiguous (along K, and along M). On Hopper and later, for one matrix
  (B == 1: activations and grads, the per-step hot path), the columnwise tile is stored through a TMA tensor
  descriptor instead of pointer stores: 20-25% faster on an H200 (docs/benchmarks.md), same bytes.
  Optionally records the amax of x in the same pass (delayed scaling, whose scale does not depend on it).
  Current scaling therefore costs 2 + 2 + 2 = 6 B/elem for both copies from bf16 (two reads, two writes);
  delayed scaling 4 B/elem.
- `_zero_empty_kernel`: zeros the `[O, D]` slabs of experts with no tokens in a grouped weight grad
  `[E, O, D]`; the token counts are read on the device (no host sync). Experts with tokens exit at once,
  so it costs a launch plus 2 B/elem (bf16) of the empty experts' slabs only.

Tiles: quantize 64 x 128 (rows x columns), 4 warps: a 16 KB bf16 tile, 128 contiguous bytes per rowwise row
and 64 per columnwise row (two full 32 B sectors), small enough for several programs per SM. amax walks
rows of up to 512 columns with up to 16 rows per tile (16 KB per iteration, 8 warps), one atomic per tile.

Imported lazily, on CUDA only (trainer/precision/quantize.py, native.py); importing it needs Triton. The
interpreter (`TRITON_INTERPRET=1`) runs it on CPU tensors for development; its fp32 -> fp8 cast rounds
half-up, not to nearest even, so there it agrees with the eager path within one fp8 ulp only.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import triton
import triton.language as tl

TensorDescriptor: Any
try:  # host-side TMA descriptors (Triton >= 3.3); without them the columnwise copy uses pointer stores
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

from trainer.kernels import capability  # cached per device
from trainer.kernels import fp8_scale
from trainer.kernels.fp8_scale import FLT_MAX
from trainer.switches import switched_off

QUANT_BLOCK_M = 64
QUANT_BLOCK_K = 128
QUANT_WARPS = 4
# With the columnwise copy stored through TMA (Hopper+, one matrix): (BLOCK_M, BLOCK_K, warps) swept on an
# H200 at T = 32768 rows and K in {1536, 3072, 4096} (docs/benchmarks.md): 64 x 64 tiles won, with 2 warps
# from K >= COL_TMA_WIDE_K on.
COL_TMA_TILE = (64, 64, 4)
COL_TMA_TILE_WIDE = (64, 64, 2)
COL_TMA_WIDE_K = 3072
AMAX_MAX_BLOCK_K = 512
AMAX_TILE = 8192  # elements per amax tile (BLOCK_M x BLOCK_K)
AMAX_WARPS = 8
ZERO_BLOCK = 4096
ZERO_PROGRAMS = 64  # programs per expert of the zeroing kernel (each strides over the slab)
SCALE_BLOCK = 32  # scale slots per step of the loops that write the per-slot and per-column scales

_TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


class Quantized(NamedTuple):
    """What `quantize` returns: the fp8 copies (None where not asked for), the encode and decode scales `[N]`,
    and for token groups the decode scales per row `[M]` and group-major per column `[N * K]` (or None)."""

    row: Optional[torch.Tensor]
    col: Optional[torch.Tensor]
    encode: torch.Tensor
    decode: torch.Tensor
    decode_rows: Optional[torch.Tensor]
    decode_cols: Optional[torch.Tensor]


@triton.jit
def _tile_amax_bits(v):
    """Per-row max of |v| of a 2-D fp32 tile, as int32 bit patterns (NaN outranks every number)."""
    return tl.max(tl.abs(v).to(tl.int32, bitcast=True), axis=1)


@triton.jit
def _record_amax(amax_ptr, ids_ptr, b, rows, row_ok, row_bits, first_row, last_row, JAGGED: tl.constexpr):
    """atomic_max the per-row maxima `row_bits` into the tile's amax slot(s): one per batch index, or one per
    token group (one atomic when the tile lies in one group, which aligned groups make the common case)."""
    if JAGGED:
        g_lo = tl.load(ids_ptr + first_row)
        g_hi = tl.load(ids_ptr + last_row)
        if g_lo == g_hi:
            tl.atomic_max(amax_ptr + g_lo, tl.max(row_bits, axis=0))
        else:
            ids = tl.load(ids_ptr + rows, mask=row_ok, other=0)
            tl.atomic_max(amax_ptr + ids, row_bits, mask=row_ok)
    else:
        tl.atomic_max(amax_ptr + b, tl.max(row_bits, axis=0))


@triton.jit
def _amax_kernel(
    x_ptr, ids_ptr, amax_ptr, M, K,
    JAGGED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """amax (int32 bits, zero-initialised) per batch index of x `[B, M, K]`, or per token group of x `[T, K]`."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    first_row = pid_m * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    base = x_ptr + b.to(tl.int64) * M * K
    row_off = rows.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        v = tl.load(base + row_off + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(v).to(tl.int32, bitcast=True))
    row_bits = tl.max(acc, axis=1)
    last_row = tl.minimum(first_row + BLOCK_M, M) - 1
    _record_amax(amax_ptr, ids_ptr, b, rows, row_ok, row_bits, first_row, last_row, JAGGED)


@triton.jit
def _scale_rule(a, FMAX: tl.constexpr, BIG: tl.constexpr, POW2: tl.constexpr):
    """encode = scale_from_amax(a) on an fp32 block (correctly rounded division, as torch's CUDA one)."""
    s = tl.math.div_rn(tl.full(a.shape, FMAX, tl.float32), a)
    # exponent bits all ones: +-inf or NaN (tested on bits: no inf literal needed)
    s_inf = (s.to(tl.int32, bitcast=True) & 0x7FFFFFFF) == 0x7F800000
    s = tl.where(s_inf, BIG, s)  # fmax / tiny amax overflows: FLT_MAX, as TE
    a_nonfinite = (a.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000
    s = tl.where((a == 0) | a_nonfinite, 1.0, s)
    if POW2:  # round down to a power of two: keep sign and exponent bits
        s = (s.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)  # ~0x7FFFFF
    return s


@triton.jit
def _encode_at(src_ptr, g, ok, FMAX: tl.constexpr, BIG: tl.constexpr, POW2: tl.constexpr, GIVEN: tl.constexpr):
    """The encode scales of slots `g` (fp32 block): `src` itself (GIVEN), or the rule applied to `src` as amax."""
    if GIVEN:
        return tl.load(src_ptr + g, mask=ok, other=1.0)
    return _scale_rule(tl.load(src_ptr + g, mask=ok, other=1.0), FMAX, BIG, POW2)


@triton.jit
def _quantize_kernel(
    x_ptr, src_ptr, ids_ptr, row_ptr, col_ptr, col_desc, amax_ptr, enc_ptr, dec_ptr, drow_ptr, dcol_ptr, M, K, N,
    FMAX: tl.constexpr, BIG: tl.constexpr, POW2: tl.constexpr, GIVEN: tl.constexpr, OUT: tl.constexpr,
    JAGGED: tl.constexpr, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, COL_TMA: tl.constexpr,
    AMAX: tl.constexpr, DEC_ROWS: tl.constexpr, DEC_COLS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """One BLOCK_M x BLOCK_K tile of x `[B, M, K]`: the encode scale of its rows' slot (batch index b, or each
    row's token group) from `src` (amax, or the given encode scales with GIVEN), scale, saturate, cast to fp8
    once, store rowwise `[B, M, K]` and/or columnwise `[B, K, M]` (as uint8 bytes; with COL_TMA, B == 1, through
    the tensor descriptor `col_desc`), optionally record max |x| (int32 bits) into `amax_ptr`.

    The slots' encode / decode scales `[N]` are written by the first tile of each batch index; with DEC_ROWS the
    tiles of the first column block also write the decode scale of each of their rows `[M]`, with DEC_COLS the
    tiles of the first row block write the group-major `[N * K]` (the layouts the native grouped GEMMs read).
    Every writer applies the same rule to the same input, so all of them hold the same bits."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    b = tl.program_id(2)
    first_row = pid_m * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < K
    mask = row_ok[:, None] & col_ok[None, :]
    base = b.to(tl.int64) * M * K
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    if JAGGED:  # one scale per token group: each row's group id
        ids = tl.load(ids_ptr + rows, mask=row_ok, other=0)
        lo = 0
        hi = N
    else:
        ids = tl.zeros([BLOCK_M], dtype=tl.int32) + b
        lo = b
        hi = b + 1
    s_M = _encode_at(src_ptr, ids, row_ok, FMAX, BIG, POW2, GIVEN)
    if (pid_m == 0) & (pid_k == 0):  # the slots' encode and decode scales
        for g0 in range(lo, hi, BLOCK_G):
            g = g0 + tl.arange(0, BLOCK_G)
            g_ok = g < hi
            s_G = _encode_at(src_ptr, g, g_ok, FMAX, BIG, POW2, GIVEN)
            tl.store(enc_ptr + g, s_G, mask=g_ok)
            tl.store(dec_ptr + g, tl.math.div_rn(tl.full([BLOCK_G], 1.0, tl.float32), s_G), mask=g_ok)
    if DEC_ROWS:
        if pid_k == 0:
            tl.store(drow_ptr + rows, tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), s_M), mask=row_ok)
    if DEC_COLS:
        if pid_m == 0:
            for g0 in range(0, N, BLOCK_G):
                g = g0 + tl.arange(0, BLOCK_G)
                g_ok = g < N
                d_G = tl.math.div_rn(
                    tl.full([BLOCK_G], 1.0, tl.float32), _encode_at(src_ptr, g, g_ok, FMAX, BIG, POW2, GIVEN)
                )  # fmt: skip
                d_GK = tl.broadcast_to(d_G[:, None], [BLOCK_G, BLOCK_K])
                tl.store(dcol_ptr + g.to(tl.int64)[:, None] * K + cols64[None, :], d_GK,
                         mask=g_ok[:, None] & col_ok[None, :])  # fmt: skip
    x = tl.load(x_ptr + base + rows64[:, None] * K + cols64[None, :], mask=mask, other=0.0).to(tl.float32)
    y = x * s_M[:, None]
    # cast_to_fp8: clamp to +-fmax (comparisons are false for NaN, so NaN stays), then round to nearest even
    y = tl.where(y > FMAX, FMAX, y)
    y = tl.where(y < -FMAX, -FMAX, y)
    q = y.to(OUT, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    # NaN: torch's cast writes 0x7F with the value's sign (E4M3's NaN, E5M2's quiet NaN); the hardware
    # conversion may pick another NaN encoding, so write torch's byte explicitly.
    nan_byte = (((y.to(tl.uint32, bitcast=True) >> 24) & 0x80) | 0x7F).to(tl.uint8)
    q = tl.where(y != y, nan_byte, q)
    if ROWWISE:
        tl.store(row_ptr + base + rows64[:, None] * K + cols64[None, :], q, mask=mask)
    if COLUMNWISE:  # the transposed tile, stored contiguous along M
        if COL_TMA:  # the TMA unit writes it from shared memory (and clips the edges)
            col_desc.store([pid_k * BLOCK_K, first_row], tl.trans(q))
        else:
            tl.store(col_ptr + base + cols64[:, None] * M + rows64[None, :], tl.trans(q),
                     mask=col_ok[:, None] & row_ok[None, :])  # fmt: skip
    if AMAX:
        last_row = tl.minimum(first_row + BLOCK_M, M) - 1
        _record_amax(amax_ptr, ids_ptr, b, rows, row_ok, _tile_amax_bits(x), first_row, last_row, JAGGED)


@triton.jit
def _zero_empty_kernel(out_ptr, offs_ptr, N, BLOCK: tl.constexpr):
    """Zero slab e (N elements) of `out` when group e has no rows (offs: cumulative group ends)."""
    e = tl.program_id(0)
    end = tl.load(offs_ptr + e)
    start = tl.load(offs_ptr + tl.maximum(e - 1, 0))
    start = tl.where(e > 0, start, 0)
    if end == start:
        base = out_ptr + e.to(tl.int64) * N
        zeros = tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty)
        step = tl.num_programs(1) * BLOCK
        for i in range(tl.program_id(1) * BLOCK, N, step):
            idx = i + tl.arange(0, BLOCK)
            tl.store(base + idx, zeros, mask=idx < N)


# ----------------------------------------------------------------------------------------------------------
# launchers


def _check_x(x_BMK: torch.Tensor, ids_T: Optional[torch.Tensor]) -> None:
    if x_BMK.dim() != 3 or not x_BMK.is_contiguous():
        raise ValueError(f"expected a contiguous [B, M, K] tensor, got shape {tuple(x_BMK.shape)}")
    if x_BMK.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8 quantization kernels read bf16, fp16 or fp32, got {x_BMK.dtype}")
    if ids_T is not None and (x_BMK.shape[0] != 1 or ids_T.numel() != x_BMK.shape[1]):
        raise ValueError("token group ids need x as [1, T, K] with one id per row")


def amax(
    x_BMK: torch.Tensor, ids_T: Optional[torch.Tensor] = None, num_groups: int = 0, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """max |x| in fp32: `[B]` for x `[B, M, K]`, or `[G]` for x `[1, T, K]` with row group ids `ids_T`
    (int64, non-decreasing, `num_groups` = G; a group without rows gets 0). NaN propagates. `out`: a zeroed
    int32 buffer of that many slots to record into (a caller that needs several amaxes zeroes them at once)."""
    _check_x(x_BMK, ids_T)
    B, M, K = x_BMK.shape
    slots = num_groups if ids_T is not None else B
    if out is None:
        out = torch.zeros(slots, dtype=torch.int32, device=x_BMK.device)
    elif out.dtype != torch.int32 or out.numel() != slots or not out.is_contiguous():
        raise ValueError(f"amax out must be a contiguous int32 tensor of {slots} slots")
    if x_BMK.numel():
        block_k = min(AMAX_MAX_BLOCK_K, triton.next_power_of_2(K))
        block_m = max(1, min(16, AMAX_TILE // block_k, triton.next_power_of_2(M)))
        _amax_kernel[(triton.cdiv(M, block_m), B)](
            x_BMK, ids_T if ids_T is not None else out, out, M, K,
            JAGGED=ids_T is not None, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=AMAX_WARPS,
        )  # fmt: skip
    return out.view(torch.float32)


def quantize(
    x_BMK: torch.Tensor,
    out_dtype: torch.dtype,
    fmax: float,
    *,
    amax: Optional[torch.Tensor] = None,
    encode: Optional[torch.Tensor] = None,
    pow2: bool = False,
    ids_T: Optional[torch.Tensor] = None,
    num_groups: int = 0,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_out: Optional[torch.Tensor] = None,
    gemm_scales: bool = False,
) -> Quantized:
    """The fp8 copies of x `[B, M, K]` (rowwise `[B, M, K]`, columnwise `[B, K, M]`) and their scales, in one
    pass over x. Scales: one per batch index, or one per token group with `ids_T` (`num_groups` = G), encode
    = scale_from_amax(`amax`) by TE's rule (fp8_scale.scale_from_amax) or the given `encode`; decode =
    1 / encode (fp8_scale.inverse). `amax_out`: an int32 `[B]` or `[G]` zero-initialised buffer that receives
    max |x| as bit patterns (view it as fp32), or None. `gemm_scales` (token groups only): also the decode
    scales per row of the rowwise copy and group-major per column of the columnwise one."""
    _check_x(x_BMK, ids_T)
    if out_dtype not in _TL_FP8:
        raise ValueError(f"fp8 output dtype must be float8_e4m3fn or float8_e5m2, got {out_dtype}")
    if not (rowwise or columnwise):
        raise ValueError("ask for at least one of rowwise / columnwise")
    if (amax is None) == (encode is None):
        raise ValueError("pass exactly one of amax and encode")
    B, M, K = x_BMK.shape
    n = num_groups if ids_T is not None else B
    dev = x_BMK.device
    src = (amax if encode is None else encode).to(device=dev, dtype=torch.float32).reshape(-1).contiguous()
    if src.numel() != n:
        raise ValueError(f"expected {n} per-tensor values, got {src.numel()}")
    expand = gemm_scales and ids_T is not None
    out = Quantized(
        torch.empty((B, M, K), dtype=out_dtype, device=dev) if rowwise else None,
        torch.empty((B, K, M), dtype=out_dtype, device=dev) if columnwise else None,
        torch.empty(n, dtype=torch.float32, device=dev),
        torch.empty(n, dtype=torch.float32, device=dev),
        torch.empty(M, dtype=torch.float32, device=dev) if expand and rowwise else None,
        torch.empty(n * K, dtype=torch.float32, device=dev) if expand and columnwise else None,
    )
    if x_BMK.numel() == 0:  # no tile to carry the scales: the eager rule (the same bits, tested)
        out.encode.copy_(src if encode is not None else fp8_scale.scale_from_amax(src, fmax, pow2))
        out.decode.copy_(fp8_scale.inverse(out.encode))
        if out.decode_cols is not None:
            out.decode_cols.copy_(out.decode.repeat_interleave(K))
        return out
    placeholder = src  # pointer arguments a constexpr switch leaves unread
    col_u8 = out.col.view(torch.uint8) if out.col is not None else None
    col_desc: object = placeholder
    block_m, block_k, warps = QUANT_BLOCK_M, QUANT_BLOCK_K, QUANT_WARPS
    if col_u8 is not None and _col_tma_ok(col_u8):
        block_m, block_k, warps = col_tma_tile(K)
        col_desc = TensorDescriptor.from_tensor(col_u8[0], [block_k, block_m])
    grid = (triton.cdiv(M, block_m), triton.cdiv(K, block_k), B)
    opt = lambda t: t if t is not None else placeholder  # noqa: E731
    _quantize_kernel[grid](
        x_BMK, src, opt(ids_T), opt(out.row.view(torch.uint8) if out.row is not None else None), opt(col_u8),
        col_desc, opt(amax_out), out.encode, out.decode, opt(out.decode_rows), opt(out.decode_cols), M, K, n,
        FMAX=fmax, BIG=FLT_MAX, POW2=pow2, GIVEN=encode is not None, OUT=_TL_FP8[out_dtype],
        JAGGED=ids_T is not None, ROWWISE=rowwise, COLUMNWISE=columnwise, COL_TMA=col_desc is not placeholder,
        AMAX=amax_out is not None, DEC_ROWS=out.decode_rows is not None, DEC_COLS=out.decode_cols is not None,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_G=SCALE_BLOCK, num_warps=warps,
    )  # fmt: skip
    return out


def col_tma_tile(K: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, warps) of the quantize kernel when it stores the columnwise copy through TMA."""
    return COL_TMA_TILE_WIDE if K >= COL_TMA_WIDE_K else COL_TMA_TILE


def _col_tma_ok(col_BKM: torch.Tensor) -> bool:
    """Whether the columnwise copy can be stored through a TMA descriptor: Hopper or later, one 2-D `[K, M]`
    matrix (a batch of weights keeps the pointer store: a tile there must not spill into the next matrix),
    rows a multiple of 16 bytes, and not switched off (`MOECTL_QUANT_TMA=0`)."""
    return (
        TensorDescriptor is not None
        and col_BKM.is_cuda
        and col_BKM.shape[0] == 1
        and col_BKM.shape[2] % 16 == 0
        and col_BKM.data_ptr() % 16 == 0
        and not switched_off("MOECTL_QUANT_TMA")
        and (capability(col_BKM.device) or (0, 0))[0] >= 9
    )


def zero_empty_groups_(out_GXY: torch.Tensor, offsets_G: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the slabs `out[g]` of the groups g without rows (`offsets_G`: cumulative group ends on
    the device, any integer dtype). No host sync; `out` must be contiguous."""
    if not out_GXY.is_contiguous() or out_GXY.shape[0] != offsets_G.numel():
        raise ValueError(f"expected a contiguous [G, ...] tensor with G = {offsets_G.numel()}, got {tuple(out_GXY.shape)}")
    G = out_GXY.shape[0]
    n = out_GXY[0].numel() if G else 0
    if G and n:
        programs = min(ZERO_PROGRAMS, triton.cdiv(n, ZERO_BLOCK))
        _zero_empty_kernel[(G, programs)](out_GXY, offsets_G.contiguous(), n, BLOCK=ZERO_BLOCK, num_warps=4)
    return out_GXY
