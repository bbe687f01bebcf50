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
- `_scales_kernel`: the scale rule on `[B]` or `[G]` values in one launch (correctly rounded divisions,
  `div_rn`, as torch's CUDA division), instead of the ~10 tiny eager ops of `scale_from_amax` + `inverse`.
  For a token-grouped tensor it also writes the decode scales expanded as the native grouped GEMMs read
  them (per row, and group-major per column), which saved two eager ops and launches per operand.
- `_quantize_kernel`: one pass, reads x once (2 B/elem) and writes the rowwise copy `[B, M, K]` (1 B/elem)
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

import functools
import os
from typing import Any, Optional

import torch
import triton
import triton.language as tl

TensorDescriptor: Any
try:  # host-side TMA descriptors (Triton >= 3.3); without them the columnwise copy uses pointer stores
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

from trainer.precision.formats import FLT_MAX

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
SCALE_BLOCK = 256

_TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


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
def _encode_at(amax_ptr, given_ptr, g, ok, FMAX: tl.constexpr, BIG: tl.constexpr, POW2: tl.constexpr,
               GIVEN: tl.constexpr):  # fmt: skip
    """The encode scales of slots `g` (fp32 block): the given ones, or the rule applied to their amax."""
    if GIVEN:
        return tl.load(given_ptr + g, mask=ok, other=1.0)
    return _scale_rule(tl.load(amax_ptr + g, mask=ok, other=1.0), FMAX, BIG, POW2)


@triton.jit
def _scales_kernel(
    amax_ptr, given_ptr, enc_ptr, dec_ptr, ids_ptr, rows_ptr, cols_ptr, N, T, R,
    FMAX: tl.constexpr, BIG: tl.constexpr, POW2: tl.constexpr, GIVEN: tl.constexpr, ROWS: tl.constexpr,
    COLS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """encode = scale_from_amax(amax) (or the given encode scales), decode = 1 / encode: fp32 `[N]`; with ROWS
    also decode per token row `rows[t] = decode[ids[t]]` `[T]`, with COLS group-major `cols[i] = decode[i // R]`
    `[N * R]` (the layouts the native grouped GEMMs read). Every output recomputes its slot's scale from the
    same input with the same operations, so all of them hold the same bits and no program waits on another."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    one = tl.full([BLOCK], 1.0, tl.float32)
    ok = i < N
    s = _encode_at(amax_ptr, given_ptr, i, ok, FMAX, BIG, POW2, GIVEN)
    tl.store(enc_ptr + i, s, mask=ok)
    tl.store(dec_ptr + i, tl.math.div_rn(one, s), mask=ok)
    if ROWS:
        row_ok = i < T
        g = tl.load(ids_ptr + i, mask=row_ok, other=0)
        s_row = _encode_at(amax_ptr, given_ptr, g, row_ok, FMAX, BIG, POW2, GIVEN)
        tl.store(rows_ptr + i, tl.math.div_rn(one, s_row), mask=row_ok)
    if COLS:
        col_ok = i < N * R
        s_col = _encode_at(amax_ptr, given_ptr, i // R, col_ok, FMAX, BIG, POW2, GIVEN)
        tl.store(cols_ptr + i, tl.math.div_rn(one, s_col), mask=col_ok)


@triton.jit
def _quantize_kernel(
    x_ptr, enc_ptr, ids_ptr, row_ptr, col_ptr, col_desc, amax_ptr, M, K,
    FMAX: tl.constexpr, OUT: tl.constexpr, JAGGED: tl.constexpr, ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr, COL_TMA: tl.constexpr, AMAX: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One BLOCK_M x BLOCK_K tile of x `[B, M, K]`: scale, saturate, cast to fp8 once, store rowwise
    `[B, M, K]` and/or columnwise `[B, K, M]` (as uint8 bytes; with COL_TMA, B == 1, through the tensor
    descriptor `col_desc`), optionally record max |x| (int32 bits) into `amax_ptr`."""
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
    x = tl.load(x_ptr + base + rows64[:, None] * K + cols64[None, :], mask=mask, other=0.0).to(tl.float32)
    if JAGGED:  # one scale per token group: gather it by each row's group id
        ids = tl.load(ids_ptr + rows, mask=row_ok, other=0)
        s = tl.load(enc_ptr + ids, mask=row_ok, other=1.0)[:, None]
    else:
        s = tl.load(enc_ptr + b)
    y = x * s
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


def amax(x_BMK: torch.Tensor, ids_T: Optional[torch.Tensor] = None, num_groups: int = 0) -> torch.Tensor:
    """max |x| in fp32: `[B]` for x `[B, M, K]`, or `[G]` for x `[1, T, K]` with row group ids `ids_T`
    (int64, non-decreasing, `num_groups` = G; a group without rows gets 0). NaN propagates."""
    _check_x(x_BMK, ids_T)
    B, M, K = x_BMK.shape
    slots = num_groups if ids_T is not None else B
    out = torch.zeros(slots, dtype=torch.int32, device=x_BMK.device)
    if x_BMK.numel():
        block_k = min(AMAX_MAX_BLOCK_K, triton.next_power_of_2(K))
        block_m = max(1, min(16, AMAX_TILE // block_k, triton.next_power_of_2(M)))
        _amax_kernel[(triton.cdiv(M, block_m), B)](
            x_BMK, ids_T if ids_T is not None else out, out, M, K,
            JAGGED=ids_T is not None, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=AMAX_WARPS,
        )  # fmt: skip
    return out.view(torch.float32)


def scales(
    n: int,
    device: torch.device,
    *,
    fmax: float,
    pow2: bool = False,
    amax: Optional[torch.Tensor] = None,
    encode: Optional[torch.Tensor] = None,
    ids_T: Optional[torch.Tensor] = None,
    cols_per_group: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(encode, decode, decode per row, decode per column) fp32: encode and decode `[n]`, from `amax` by TE's
    rule (fp8_scale.scale_from_amax) or the given `encode` scales, decode = 1 / encode (fp8_scale.inverse).
    With token-group ids `ids_T`, also decode per row `[T]` = decode[ids]; with `cols_per_group` R > 0, also
    the group-major `[n * R]` = decode repeated R times each. The expansions are None when not asked for."""
    if (amax is None) == (encode is None):
        raise ValueError("pass exactly one of amax and encode")
    src = (amax if encode is None else encode).to(device=device, dtype=torch.float32).reshape(-1).contiguous()
    if src.numel() != n:
        raise ValueError(f"expected {n} per-tensor values, got {src.numel()}")
    enc = torch.empty(n, dtype=torch.float32, device=device)
    dec = torch.empty(n, dtype=torch.float32, device=device)
    T = ids_T.numel() if ids_T is not None else 0
    rows = torch.empty(T, dtype=torch.float32, device=device) if ids_T is not None else None
    cols = torch.empty(n * cols_per_group, dtype=torch.float32, device=device) if cols_per_group > 0 else None
    span = max(n, T, n * cols_per_group)
    if n and span:
        _scales_kernel[(triton.cdiv(span, SCALE_BLOCK),)](
            src, src, enc, dec, ids_T if ids_T is not None else src, rows if rows is not None else enc,
            cols if cols is not None else enc, n, T, max(cols_per_group, 1),
            FMAX=fmax, BIG=FLT_MAX, POW2=pow2, GIVEN=encode is not None, ROWS=rows is not None,
            COLS=cols is not None, BLOCK=SCALE_BLOCK,
        )  # fmt: skip
    return enc, dec, rows, cols


def quantize(
    x_BMK: torch.Tensor,
    encode: torch.Tensor,
    out_dtype: torch.dtype,
    fmax: float,
    *,
    ids_T: Optional[torch.Tensor] = None,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_out: Optional[torch.Tensor] = None,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(rowwise `[B, M, K]`, columnwise `[B, K, M]`) fp8 copies of x scaled by `encode` (fp32, one per batch
    index, or one per token group with `ids_T`), in one pass over x. `amax_out`: an int32 `[B]` or `[G]`
    zero-initialised buffer that receives max |x| as bit patterns (view it as fp32), or None."""
    _check_x(x_BMK, ids_T)
    if out_dtype not in _TL_FP8:
        raise ValueError(f"fp8 output dtype must be float8_e4m3fn or float8_e5m2, got {out_dtype}")
    if not (rowwise or columnwise):
        raise ValueError("ask for at least one of rowwise / columnwise")
    B, M, K = x_BMK.shape
    dev = x_BMK.device
    row = torch.empty((B, M, K), dtype=out_dtype, device=dev) if rowwise else None
    col = torch.empty((B, K, M), dtype=out_dtype, device=dev) if columnwise else None
    if x_BMK.numel():
        enc = encode.to(torch.float32).reshape(-1).contiguous()
        placeholder = enc  # pointer arguments a constexpr switch leaves unread
        col_u8 = col.view(torch.uint8) if col is not None else None
        col_desc: object = placeholder
        block_m, block_k, warps = QUANT_BLOCK_M, QUANT_BLOCK_K, QUANT_WARPS
        if col_u8 is not None and _col_tma_ok(col_u8):
            block_m, block_k, warps = col_tma_tile(K)
            col_desc = TensorDescriptor.from_tensor(col_u8[0], [block_k, block_m])
        grid = (triton.cdiv(M, block_m), triton.cdiv(K, block_k), B)
        _quantize_kernel[grid](
            x_BMK, enc, ids_T if ids_T is not None else placeholder,
            row.view(torch.uint8) if row is not None else placeholder,
            col_u8 if col_u8 is not None else placeholder, col_desc,
            amax_out if amax_out is not None else placeholder, M, K,
            FMAX=fmax, OUT=_TL_FP8[out_dtype], JAGGED=ids_T is not None, ROWWISE=rowwise, COLUMNWISE=columnwise,
            COL_TMA=col_desc is not placeholder, AMAX=amax_out is not None, BLOCK_M=block_m, BLOCK_K=block_k,
            num_warps=warps,
        )  # fmt: skip
    return row, col


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
        and os.environ.get("MOECTL_QUANT_TMA", "1") != "0"
        and _major(col_BKM.device.index if col_BKM.device.index is not None else torch.cuda.current_device()) >= 9
    )


@functools.lru_cache(maxsize=None)
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]  # cached: the query costs ~40 us of host time


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
