"""MXFP8 quantization on CUDA (Triton): both copies of a tensor in one pass, E8M0 scales per 1x32 block.

The reference is the eager MX kind (trainer/precision/kinds/mx.py), and this kernel writes exactly its bytes:

    block amax  max |x| over 32 consecutive values along the copy's last dim (rows of x for the rowwise copy,
                columns of x for the columnwise one); the ragged last block is zero padded; NaN propagates
    exponent    floor:  floor(log2 amax) - emax_elem          rceil: ceil(log2(amax * fp32(1 / fmax)))
                amax == 0 gives -127; both clamped to E8M0's [-127, 127]; inf/NaN amax: scale byte 255
    data        cast_to_fp8(x * 2^-exponent) (an exact power of two: no rounding before the cast), saturating
                to +-fmax, round to nearest even; every element of a NaN block is the NaN byte 0x7F
    scale       the E8M0 byte exponent + 127 (255 for NaN)

Both exponents are read from the fp32 bits of amax (exponent field and mantissa), which is what `frexp` gives
the eager path, subnormals included.

Why: the eager kind makes ~15 full passes (fp32 copy, abs, pad, amax, frexp, ldexp, where, clamp, cast, and
again for the transposed copy); MXFP8 param gather re-quantizes every gathered weight on every rank each step
(`reuse_grad_buf_for_mxfp8_param_ag`), which made its gather 17x the bf16 one (docs/benchmarks.md). This
kernel reads x once in its own dtype and writes 1 byte per element per copy plus 1/32 byte of scales.

Tile: 64 x 64 elements of x (two 32-blocks each way), the rowwise copy and its scales stored along K, the
columnwise copy (transposed in registers) and its scales along M. Imported lazily, CUDA only.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from trainer.kernels.fp8_quant_triton import _TL_FP8, _check_x

BLOCK = 32  # MX block length (OCP MX v1.0)
TILE_M = 64
TILE_K = 64
WARPS = 4


class MXQuantized(NamedTuple):
    """The copies (None where not asked for): data fp8 `[B, M, K]` / `[B, K, M]`, scales e8m0
    `[B, M, ceil(K/32)]` / `[B, K, ceil(M/32)]`."""

    row: Optional[torch.Tensor]
    row_scale: Optional[torch.Tensor]
    col: Optional[torch.Tensor]
    col_scale: Optional[torch.Tensor]


@triton.jit
def _exponent(amax_bits, EMAX: tl.constexpr, INV_FMAX: tl.constexpr, RCEIL: tl.constexpr):
    """The unbiased E8M0 exponent (int32, clamped to [-127, 127]) of non-negative fp32 amaxes given as bits."""
    ef = (amax_bits >> 23) & 0xFF
    if RCEIL:  # ceil(log2(amax * (1 / fmax))), from the bits of the fp32 product
        d = (amax_bits.to(tl.float32, bitcast=True) * INV_FMAX).to(tl.int32, bitcast=True)
        df = (d >> 23) & 0xFF
        dm = d & 0x7FFFFF
        e = tl.where(df == 0, tl.where(dm > 0x400000, -126, -127), df - 127 + (dm != 0).to(tl.int32))
    else:  # floor(log2 amax) - emax; a subnormal amax is below 2^-126 and clamps to -127 anyway
        e = tl.where(ef == 0, -127, ef - 127 - EMAX)
    e = tl.where(amax_bits == 0, -127, e)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _scaled_bytes(x, e, nan, FMAX: tl.constexpr, OUT: tl.constexpr):
    """fp8 bytes of x * 2^-e (e broadcast to x's shape), saturating; the NaN byte where `nan`."""
    # 2^-e for e in [-127, 127]: a normal fp32 except 2^-127 (subnormal bit 22)
    factor = tl.where(e < 127, (127 - e) << 23, 0x400000).to(tl.float32, bitcast=True)
    y = x * factor
    y = tl.where(y > FMAX, FMAX, y)
    y = tl.where(y < -FMAX, -FMAX, y)
    q = y.to(OUT, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    return tl.where(nan, 0x7F, q).to(tl.uint8)


@triton.jit
def _mx_quantize_kernel(
    x_ptr, row_ptr, rs_ptr, col_ptr, cs_ptr, M, K, KB, MB,
    FMAX: tl.constexpr, EMAX: tl.constexpr, INV_FMAX: tl.constexpr, RCEIL: tl.constexpr, OUT: tl.constexpr,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, TM: tl.constexpr, TK: tl.constexpr, BLK: tl.constexpr,
):  # fmt: skip
    """One TM x TK tile of x `[B, M, K]`: rowwise copy `[B, M, K]` with scales `[B, M, KB]`, columnwise copy
    `[B, K, M]` with scales `[B, K, MB]` (KB = ceil(K/32), MB = ceil(M/32))."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = pid_m * TM + tl.arange(0, TM)
    cols = pid_k * TK + tl.arange(0, TK)
    row_ok = rows < M
    col_ok = cols < K
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    x = tl.load(x_ptr + b * M * K + rows64[:, None] * K + cols64[None, :], mask=mask, other=0.0).to(tl.float32)
    bits = tl.abs(x).to(tl.int32, bitcast=True)  # |x| bits order like |x|; NaN's exceed inf's
    if ROWWISE:  # blocks of 32 along K: [TM, TK/32]
        amax_r = tl.max(tl.reshape(bits, (TM, TK // BLK, BLK)), axis=2)
        e_r = _exponent(amax_r, EMAX, INV_FMAX, RCEIL)
        nan_r = ((amax_r >> 23) & 0xFF) == 0xFF
        e_full = tl.reshape(tl.broadcast_to(e_r[:, :, None], (TM, TK // BLK, BLK)), (TM, TK))
        nan_full = tl.reshape(tl.broadcast_to(nan_r[:, :, None], (TM, TK // BLK, BLK)), (TM, TK))
        q = _scaled_bytes(x, e_full, nan_full, FMAX, OUT)
        tl.store(row_ptr + b * M * K + rows64[:, None] * K + cols64[None, :], q, mask=mask)
        kb = pid_k * (TK // BLK) + tl.arange(0, TK // BLK)
        byte = tl.where(nan_r, 255, e_r + 127).to(tl.uint8)
        tl.store(rs_ptr + b * M * KB + rows64[:, None] * KB + kb[None, :], byte,
                 mask=row_ok[:, None] & (kb < KB)[None, :])  # fmt: skip
    if COLUMNWISE:  # blocks of 32 along M: [TM/32, TK]
        amax_c = tl.max(tl.reshape(bits, (TM // BLK, BLK, TK)), axis=1)
        e_c = _exponent(amax_c, EMAX, INV_FMAX, RCEIL)
        nan_c = ((amax_c >> 23) & 0xFF) == 0xFF
        e_full = tl.reshape(tl.broadcast_to(e_c[:, None, :], (TM // BLK, BLK, TK)), (TM, TK))
        nan_full = tl.reshape(tl.broadcast_to(nan_c[:, None, :], (TM // BLK, BLK, TK)), (TM, TK))
        q = _scaled_bytes(x, e_full, nan_full, FMAX, OUT)
        tl.store(col_ptr + b * K * M + cols64[:, None] * M + rows64[None, :], tl.trans(q),
                 mask=col_ok[:, None] & row_ok[None, :])  # fmt: skip
        mb = pid_m * (TM // BLK) + tl.arange(0, TM // BLK)
        byte = tl.where(nan_c, 255, e_c + 127).to(tl.uint8)
        tl.store(cs_ptr + b * K * MB + cols64[:, None] * MB + mb[None, :], tl.trans(byte),
                 mask=col_ok[:, None] & (mb < MB)[None, :])  # fmt: skip


def quantize(
    x_BMK: torch.Tensor,
    out_dtype: torch.dtype,
    fmax: float,
    emax: int,
    *,
    rounding: str = "floor",
    rowwise: bool = True,
    columnwise: bool = False,
) -> MXQuantized:
    """MXFP8 copies of a contiguous bf16/fp16/fp32 x `[B, M, K]` in one pass (see the module docstring)."""
    _check_x(x_BMK, None)
    if out_dtype not in _TL_FP8:
        raise ValueError(f"fp8 output dtype must be float8_e4m3fn or float8_e5m2, got {out_dtype}")
    if rounding not in ("floor", "rceil"):
        raise ValueError(f"unknown MX scale rounding {rounding!r}; expected 'floor' or 'rceil'")
    B, M, K = x_BMK.shape
    kb, mb = triton.cdiv(K, BLOCK), triton.cdiv(M, BLOCK)
    dev = x_BMK.device
    out = MXQuantized(
        torch.empty((B, M, K), dtype=out_dtype, device=dev) if rowwise else None,
        torch.empty((B, M, kb), dtype=torch.uint8, device=dev) if rowwise else None,
        torch.empty((B, K, M), dtype=out_dtype, device=dev) if columnwise else None,
        torch.empty((B, K, mb), dtype=torch.uint8, device=dev) if columnwise else None,
    )
    if x_BMK.numel():
        # fp32(1 / fmax) as torch computes it (kinds/mx.py), passed as the exact float it is
        inv_fmax = (torch.tensor(1.0, dtype=torch.float32) / fmax).item()
        placeholder = out.row if out.row is not None else out.col
        u8 = lambda t: t.view(torch.uint8) if t is not None else placeholder  # noqa: E731
        grid = (triton.cdiv(M, TILE_M), triton.cdiv(K, TILE_K), B)
        _mx_quantize_kernel[grid](
            x_BMK, u8(out.row), u8(out.row_scale), u8(out.col), u8(out.col_scale), M, K, kb, mb,
            FMAX=fmax, EMAX=emax, INV_FMAX=inv_fmax, RCEIL=rounding == "rceil", OUT=_TL_FP8[out_dtype],
            ROWWISE=rowwise, COLUMNWISE=columnwise, TM=TILE_M, TK=TILE_K, BLK=BLOCK, num_warps=WARPS,
        )  # fmt: skip
    e8m0 = lambda t: t.view(torch.float8_e8m0fnu) if t is not None else None  # noqa: E731
    return MXQuantized(out.row, e8m0(out.row_scale), out.col, e8m0(out.col_scale))
