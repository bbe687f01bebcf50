"""Triton kernels for the fused expert activation (forward, backward) and the fc2 bias epilogue.

Same math as `expert_math.fused_forward` / `fused_backward` (trainer/moe/expert_math.py: read its docstring for the formula, the layouts and why the routing
probabilities are applied inside the activation). Legend: P rows, H fc1 width, F ffn width, E experts.

- forward: reads h (the fc1 output, without bias), probs, optionally b1 by each row's expert, and writes
  a = probs * act(h + b1) in h's dtype. 2-D grid over (row tiles, column tiles); nothing to reduce.
- backward: reads h, probs and da (the grad of a), writes dh, the recomputed a (fc2's weight grad needs it,
  and producing it here saves a second pass over h) and dprobs = sum_f da * act. One program owns a tile of
  rows and walks all of F, so dprobs is a register reduction: deterministic, no atomics.
- bias epilogue: y[r] += p[r] * b2[expert[r]], in place (fc2's bias under the routing scale).

Gate and up columns are read in place in either fc1 layout (`[gate; up]` or blocks of I interleaved):
column f of the gate lives at f (contiguous) or (f // I) * 2I + f % I (interleaved), and its up partner
F or I further on. No de-interleave copy. I/O in bf16, fp16 or fp32; math in fp32.

Imported lazily by the fused backend on CUDA only; importing it needs Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from trainer.kernels.fp8_quant_triton import _record_amax
from moectl.core.facts import QUICK_GELU_ALPHA, check_activation, ffn_width, is_gated

_ACT_CODE = {"swiglu": 0, "quick_geglu": 1, "squared_relu": 2}


def _sigmoid_scale(activation: str) -> float:
    """The gate's sigmoid scale: silu is g * sigmoid(g), quick_gelu g * sigmoid(1.702 g)."""
    return QUICK_GELU_ALPHA if activation == "quick_geglu" else 1.0


@triton.jit
def _gate_up_cols(cols, F, INTERLEAVE: tl.constexpr):
    """Column offsets of gate and up for ffn columns `cols` in either fc1 layout."""
    if INTERLEAVE > 0:
        g_cols = (cols // INTERLEAVE) * (2 * INTERLEAVE) + cols % INTERLEAVE
        u_cols = g_cols + INTERLEAVE
    else:
        g_cols = cols
        u_cols = cols + F
    return g_cols, u_cols


@triton.jit
def _load_h(h_ptr, b_ptr, h_row, b_row, c, mask, HAS_BIAS: tl.constexpr):
    """h (+ bias of the row's expert) at columns c, as fp32."""
    v = tl.load(h_ptr + h_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(b_ptr + b_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _glu_fwd_kernel(
    h_ptr, p_ptr, b_ptr, e_ptr, a_ptr, ids_ptr, amax_ptr,
    P, F, stride_h, stride_a, stride_b,
    ACT: tl.constexpr, INTERLEAVE: tl.constexpr, HAS_PROBS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALE: tl.constexpr, AMAX: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_ok = rows < P
    mask = row_ok[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)
    h_row = (rows64 * stride_h)[:, None]
    b_row = rows64[:, None] * 0
    if HAS_BIAS:
        experts = tl.load(e_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        b_row = (experts * stride_b)[:, None]
    if ACT == 2:  # squared_relu: not gated
        r = tl.maximum(_load_h(h_ptr, b_ptr, h_row, b_row, cols, mask, HAS_BIAS), 0.0)
        act = r * r
    else:
        g_cols, u_cols = _gate_up_cols(cols, F, INTERLEAVE)
        g = _load_h(h_ptr, b_ptr, h_row, b_row, g_cols, mask, HAS_BIAS)
        u = _load_h(h_ptr, b_ptr, h_row, b_row, u_cols, mask, HAS_BIAS)
        act = g * tl.sigmoid(SCALE * g) * u
    if HAS_PROBS:
        act = act * tl.load(p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out = act.to(a_ptr.dtype.element_ty)
    tl.store(a_ptr + (rows64 * stride_a)[:, None] + cols[None, :], out, mask=mask)
    if AMAX:  # max |a| as stored, per token group (masked lanes hold act(0) = 0)
        bits = tl.max(tl.abs(out.to(tl.float32)).to(tl.int32, bitcast=True), axis=1)
        first = tl.program_id(0) * BLOCK_P
        _record_amax(amax_ptr, ids_ptr, 0, rows, row_ok, bits, first, tl.minimum(first + BLOCK_P, P) - 1, True)


@triton.jit
def _glu_bwd_kernel(
    h_ptr, p_ptr, b_ptr, e_ptr, da_ptr, dh_ptr, a_ptr, dp_ptr, ids_ptr, amax_ptr,
    P, F, stride_h, stride_da, stride_dh, stride_a, stride_b,
    ACT: tl.constexpr, INTERLEAVE: tl.constexpr, HAS_PROBS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALE: tl.constexpr, AMAX: tl.constexpr, WRITE_A: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    row_ok = rows < P
    rows64 = rows.to(tl.int64)
    h_row = (rows64 * stride_h)[:, None]
    b_row = rows64[:, None] * 0
    if HAS_BIAS:
        experts = tl.load(e_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        b_row = (experts * stride_b)[:, None]
    p = tl.full((BLOCK_P,), 1.0, tl.float32)
    if HAS_PROBS:
        p = tl.load(p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    dp = tl.zeros((BLOCK_P,), tl.float32)
    bits = tl.zeros((BLOCK_P,), tl.int32)  # max |dh| as stored, per row (AMAX)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = row_ok[:, None] & (cols < F)[None, :]
        da = tl.load(da_ptr + (rows64 * stride_da)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dact = da * p[:, None]
        if ACT == 2:
            r = tl.maximum(_load_h(h_ptr, b_ptr, h_row, b_row, cols, mask, HAS_BIAS), 0.0)
            act = r * r
            dr = (2.0 * r * dact).to(dh_ptr.dtype.element_ty)
            tl.store(dh_ptr + (rows64 * stride_dh)[:, None] + cols[None, :], dr, mask=mask)
            if AMAX:
                bits = tl.maximum(bits, tl.max(tl.abs(dr.to(tl.float32)).to(tl.int32, bitcast=True), axis=1))
        else:
            g_cols, u_cols = _gate_up_cols(cols, F, INTERLEAVE)
            g = _load_h(h_ptr, b_ptr, h_row, b_row, g_cols, mask, HAS_BIAS)
            u = _load_h(h_ptr, b_ptr, h_row, b_row, u_cols, mask, HAS_BIAS)
            s = tl.sigmoid(SCALE * g)
            gs = g * s
            act = gs * u
            dh_row = (rows64 * stride_dh)[:, None]
            dg = dact * u * (s + SCALE * gs * (1.0 - s))
            dg = dg.to(dh_ptr.dtype.element_ty)
            du = (dact * gs).to(dh_ptr.dtype.element_ty)
            tl.store(dh_ptr + dh_row + g_cols[None, :], dg, mask=mask)
            tl.store(dh_ptr + dh_row + u_cols[None, :], du, mask=mask)
            if AMAX:
                big = tl.maximum(tl.abs(dg.to(tl.float32)), tl.abs(du.to(tl.float32)))
                bits = tl.maximum(bits, tl.max(big.to(tl.int32, bitcast=True), axis=1))
        dp += tl.sum(da * act, axis=1)
        if WRITE_A:
            tl.store(a_ptr + (rows64 * stride_a)[:, None] + cols[None, :],
                     (act * p[:, None]).to(a_ptr.dtype.element_ty), mask=mask)  # fmt: skip
    if HAS_PROBS:
        tl.store(dp_ptr + rows, dp, mask=row_ok)
    if AMAX:
        first = tl.program_id(0) * BLOCK_P
        _record_amax(amax_ptr, ids_ptr, 0, rows, row_ok, bits, first, tl.minimum(first + BLOCK_P, P) - 1, True)


@triton.jit
def _row_bias_kernel(
    y_ptr, p_ptr, b_ptr, e_ptr, P, D, stride_y, stride_b,
    HAS_PROBS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < P
    mask = row_ok[:, None] & (cols < D)[None, :]
    experts = tl.load(e_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    bias = tl.load(b_ptr + (experts * stride_b)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_PROBS:
        bias = bias * tl.load(p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    y_offs = (rows.to(tl.int64) * stride_y)[:, None] + cols[None, :]
    y = tl.load(y_ptr + y_offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + y_offs, (y + bias).to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Tile:
    """Launch shape of a kernel: rows and columns per program (powers of two) and warps per program."""

    rows: int
    cols: int
    warps: int = 4


def _tile(width: int, elems: int, max_cols: int = 128, warps: int = 4) -> Tile:
    """Up to `max_cols` columns per row (at least 256 contiguous bytes of bf16 at 128), `elems` per tile."""
    cols = min(max_cols, triton.next_power_of_2(max(width, 16)))
    return Tile(max(1, elems // cols), cols, warps)


def _check(h_PH: torch.Tensor, activation: str, interleave: int | None) -> int:
    check_activation(activation)
    if h_PH.dim() != 2 or h_PH.stride(1) != 1:
        raise ValueError("h_PH must be a 2-D tensor with contiguous rows")
    return ffn_width(h_PH.shape[1], activation, interleave)


def _bias_args(
    h_PH: torch.Tensor, bias_EH: torch.Tensor | None, expert_P: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Kernel pointers for the optional bias (dummies when absent; the kernel never reads them then)."""
    if bias_EH is None:
        return h_PH, h_PH, 0
    if expert_P is None:
        raise ValueError("a bias needs expert_P, the expert index of every row")
    bias_EH = bias_EH.contiguous()
    return bias_EH, expert_P.contiguous(), bias_EH.stride(0)


def glu_forward(
    h_PH: torch.Tensor,
    probs_P: torch.Tensor | None,
    activation: str,
    interleave: int | None = None,
    bias_EH: torch.Tensor | None = None,
    expert_P: torch.Tensor | None = None,
    tile: Tile | None = None,
    amax_groups: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """a_PF = probs * act(h + b1[expert]); same contract as `expert_math.fused_forward` (trainer/moe).

    `tile` overrides the launch shape (for tuning; the default is what the benchmark chose).
    `amax_groups` = (group id of every row `[P]`, zeroed int32 `[G]`): also record max |a| per row group (as
    stored, fp32 bit patterns, NaN winning) for fc2's per-tensor FP8 quantizer, which then skips its amax pass.
    Rows of a tile must belong to one group or the kernel takes one atomic per row (groups start on multiples
    of the recipe's align_size, 16, so tiles of up to 16 rows do).
    """
    f = _check(h_PH, activation, interleave)
    p_rows = h_PH.shape[0]
    a_PF = torch.empty(p_rows, f, dtype=h_PH.dtype, device=h_PH.device)
    if p_rows == 0 or f == 0:
        return a_PF
    b, e, stride_b = _bias_args(h_PH, bias_EH, expert_P)
    probs = probs_P.contiguous() if probs_P is not None else h_PH
    # 8 x 512 tiles: measured on an H200 at the benchmark's shapes, 2-4% faster than 32 x 128 (fewer programs)
    t = tile or _tile(f, 4096, max_cols=512)
    grid = (triton.cdiv(p_rows, t.rows), triton.cdiv(f, t.cols))
    ids, amax = amax_groups if amax_groups is not None else (a_PF, a_PF)
    _glu_fwd_kernel[grid](
        h_PH, probs, b, e, a_PF, ids, amax, p_rows, f, h_PH.stride(0), a_PF.stride(0), stride_b,
        ACT=_ACT_CODE[activation], INTERLEAVE=(interleave or 0) if is_gated(activation) else 0,
        HAS_PROBS=probs_P is not None, HAS_BIAS=bias_EH is not None, SCALE=_sigmoid_scale(activation),
        AMAX=amax_groups is not None, BLOCK_P=t.rows, BLOCK_F=t.cols, num_warps=t.warps,
    )  # fmt: skip
    return a_PF


def glu_backward(
    h_PH: torch.Tensor,
    probs_P: torch.Tensor | None,
    da_PF: torch.Tensor,
    activation: str,
    interleave: int | None = None,
    bias_EH: torch.Tensor | None = None,
    expert_P: torch.Tensor | None = None,
    tile: Tile | None = None,
    amax_groups: tuple[torch.Tensor, torch.Tensor] | None = None,
    write_a: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dh_PH, dprobs_P, a_PF recomputed); same contract as `expert_math.fused_backward` (trainer/moe).

    `tile.cols` is the column step of each program's walk over F; `tile` overrides the default.
    `amax_groups`: as in `glu_forward`, for max |dh| (fc1's grad quantizer). `write_a=False` skips the
    recomputed a (None is returned): the FP8 path kept a's quantized copy from forward instead.
    """
    f = _check(h_PH, activation, interleave)
    p_rows = h_PH.shape[0]
    if da_PF.shape != (p_rows, f):
        raise ValueError(f"da_PF has shape {tuple(da_PF.shape)}, expected {(p_rows, f)}")
    da_PF = da_PF if da_PF.stride(1) == 1 else da_PF.contiguous()
    dh_PH = torch.empty_like(h_PH, memory_format=torch.contiguous_format)
    a_PF = torch.empty(p_rows, f if write_a else 0, dtype=h_PH.dtype, device=h_PH.device)
    dp32_P = torch.empty(p_rows, dtype=torch.float32, device=h_PH.device) if probs_P is not None else None
    if p_rows and f:
        ids, amax = amax_groups if amax_groups is not None else (h_PH, h_PH)
        b, e, stride_b = _bias_args(h_PH, bias_EH, expert_P)
        probs = probs_P.contiguous() if probs_P is not None else h_PH
        # 4 rows x 512 columns per step: measured on an H200, up to 10% faster than 16 x 128 at F = 14336
        t = tile or _tile(f, 2048, max_cols=512)
        _glu_bwd_kernel[(triton.cdiv(p_rows, t.rows),)](
            h_PH, probs, b, e, da_PF, dh_PH, a_PF if write_a else h_PH, dp32_P if dp32_P is not None else h_PH,
            ids, amax, p_rows, f, h_PH.stride(0), da_PF.stride(0), dh_PH.stride(0), f if not write_a else a_PF.stride(0),
            stride_b, ACT=_ACT_CODE[activation], INTERLEAVE=(interleave or 0) if is_gated(activation) else 0,
            HAS_PROBS=probs_P is not None, HAS_BIAS=bias_EH is not None, SCALE=_sigmoid_scale(activation),
            AMAX=amax_groups is not None, WRITE_A=write_a, BLOCK_P=t.rows, BLOCK_F=t.cols, num_warps=t.warps,
        )  # fmt: skip
    elif dp32_P is not None:
        dp32_P.zero_()
    dprobs_P = dp32_P.to(probs_P.dtype) if probs_P is not None and dp32_P is not None else None
    return dh_PH, dprobs_P, a_PF if write_a else None


def add_row_bias_(
    y_PD: torch.Tensor, probs_P: torch.Tensor | None, bias_ED: torch.Tensor, expert_P: torch.Tensor
) -> torch.Tensor:
    """y += probs[:, None] * bias[expert] in place, in one read and one write of y; returns y."""
    p_rows, d = y_PD.shape
    if p_rows == 0 or d == 0:
        return y_PD
    if y_PD.stride(1) != 1:
        raise ValueError("y_PD must have contiguous rows")
    bias_ED = bias_ED.contiguous()
    t = _tile(d, 4096)
    grid = (triton.cdiv(p_rows, t.rows), triton.cdiv(d, t.cols))
    _row_bias_kernel[grid](
        y_PD, probs_P.contiguous() if probs_P is not None else y_PD, bias_ED, expert_P.contiguous(),
        p_rows, d, y_PD.stride(0), bias_ED.stride(0),
        HAS_PROBS=probs_P is not None, BLOCK_P=t.rows, BLOCK_D=t.cols, num_warps=t.warps,
    )  # fmt: skip
    return y_PD
