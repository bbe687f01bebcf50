"""Triton kernels of `trainer.rope.rope_qkv`: the qkv projection split into rotated q and k and v, and back.

    forward   qkv [B*S, G, N/G + 2, C] -> q [B*S, N, C] (rotated), k [B*S, G, C] (rotated), v [B*S, G, C]
    backward  dq, dk, dv (any strides over B, S, heads)  -> dqkv [B*S, G, N/G + 2, C]

A program owns BLOCK_T tokens of one query group: it reads the positions' cos/sin once (`rope.rope_cache`'s
`[S, C/2, 2]` table), then for each of the group's heads (its query heads, its key head, its value head)
loads the two halves, rotates them in fp32 and rounds once, as `rope.apply_rope` does (the value is copied);
the backward applies the inverse rotation `(d1 cos + d2 sin, d2 cos - d1 sin)`, the sums autograd forms. Each
pass reads and writes every element once. Both run without fused multiply-adds (`enable_fp_fusion=False`), so each product and sum rounds as torch's eager ops
round them: the kernels are bitwise `rope.rope_qkv_reference` and its backward on the same device.

Imported lazily on CUDA only; importing it needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 32  # tokens per program
NUM_WARPS = 4


@triton.jit
def _cos_sin(cs_ptr, pos, t_ok, HALF: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr):
    # the `[S, C/2, 2]` table's rows for these positions, read as contiguous `[BLOCK_T, C]` and split in registers
    # (HP: C/2 rounded up to a power of two, the lanes past C/2 masked)
    cc = tl.arange(0, 2 * HP)
    cs = tl.load(cs_ptr + pos[:, None] * (2 * HALF) + cc[None, :], mask=t_ok & (cc < 2 * HALF)[None, :], other=0.0)
    return tl.split(tl.reshape(cs, (BLOCK_T, HP, 2)))


@triton.jit
def _rope_fwd_kernel(qkv_ptr, cs_ptr, q_ptr, k_ptr, v_ptr, T, S, G: tl.constexpr, PER: tl.constexpr,
                     HALF: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.program_id(1).to(tl.int64)  # every offset in int64: B*S*R passes 2^31 at long contexts
    c = tl.arange(0, HP)[None, :]
    t_ok = (t < T)[:, None]
    m = t_ok & (c < HALF)
    t64 = t.to(tl.int64)[:, None]
    cos, sin = _cos_sin(cs_ptr, (t % S).to(tl.int64), t_ok, HALF, HP, BLOCK_T)  # once for the group's heads
    row = qkv_ptr + t64 * (G * (PER + 2) * 2 * HALF) + g * ((PER + 2) * 2 * HALF) + c
    for j in tl.static_range(PER + 2):  # the group's query heads, its key head, its value head
        x1 = tl.load(row + j * (2 * HALF), mask=m, other=0.0)
        x2 = tl.load(row + j * (2 * HALF) + HALF, mask=m, other=0.0)
        if j == PER + 1:
            dst = v_ptr + (t64 * G + g) * (2 * HALF) + c
            tl.store(dst, x1, mask=m)
            tl.store(dst + HALF, x2, mask=m)
        else:
            if j == PER:
                dst = k_ptr + (t64 * G + g) * (2 * HALF) + c
            else:
                dst = q_ptr + (t64 * (G * PER) + g * PER + j) * (2 * HALF) + c
            a = x1.to(tl.float32)
            b = x2.to(tl.float32)
            tl.store(dst, (a * cos - b * sin).to(x1.dtype), mask=m)
            tl.store(dst + HALF, (b * cos + a * sin).to(x1.dtype), mask=m)


@triton.jit
def _rope_bwd_kernel(dq_ptr, dk_ptr, dv_ptr, cs_ptr, dqkv_ptr, T, S, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s,
                     sv_h, G: tl.constexpr, PER: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr,
                     BLOCK_T: tl.constexpr):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.program_id(1).to(tl.int64)  # int64: a head's stride times the head index passes 2^31 at long contexts
    c = tl.arange(0, HP)[None, :]
    t_ok = (t < T)[:, None]
    m = t_ok & (c < HALF)
    t64 = t.to(tl.int64)
    b_idx = (t64 // S)[:, None]
    s_idx = t64 % S
    cos, sin = _cos_sin(cs_ptr, s_idx, t_ok, HALF, HP, BLOCK_T)
    s_idx = s_idx[:, None]
    row = dqkv_ptr + t64[:, None] * (G * (PER + 2) * 2 * HALF) + g * ((PER + 2) * 2 * HALF) + c
    for j in tl.static_range(PER + 2):
        if j == PER + 1:
            src = dv_ptr + b_idx * sv_b + s_idx * sv_s + g * sv_h + c
            tl.store(row + j * (2 * HALF), tl.load(src, mask=m, other=0.0), mask=m)
            tl.store(row + j * (2 * HALF) + HALF, tl.load(src + HALF, mask=m, other=0.0), mask=m)
        else:
            if j == PER:
                src = dk_ptr + b_idx * sk_b + s_idx * sk_s + g * sk_h + c
            else:
                src = dq_ptr + b_idx * sq_b + s_idx * sq_s + (g * PER + j) * sq_h + c
            d1 = tl.load(src, mask=m, other=0.0)
            d2 = tl.load(src + HALF, mask=m, other=0.0)
            a = d1.to(tl.float32)
            b = d2.to(tl.float32)
            tl.store(row + j * (2 * HALF), (a * cos + b * sin).to(d1.dtype), mask=m)
            tl.store(row + j * (2 * HALF) + HALF, (b * cos - a * sin).to(d1.dtype), mask=m)


def _dims(r: int, num_heads: int, num_groups: int, cache: torch.Tensor, s: int) -> tuple[int, int]:
    """(query heads per group, C) of a projection with R columns, after checking the cos/sin table covers `s`
    positions of head dim C (the reference would fail on a short table; a kernel would read past it)."""
    per, c = num_heads // num_groups, r // (num_heads + 2 * num_groups)
    if per * num_groups != num_heads or c * (num_heads + 2 * num_groups) != r or c < 2 or c % 2:
        raise ValueError(f"rope_qkv: {r} columns for {num_heads} heads in {num_groups} groups (C even)")
    if cache.dim() != 3 or cache.shape[0] < s or cache.shape[1] * 2 != c or cache.shape[2] != 2:
        raise ValueError(f"rope_qkv: a cos/sin table {tuple(cache.shape)} for {s} positions of head dim {c}")
    return per, c


def rope_qkv_forward(qkv_BSR: torch.Tensor, cache: torch.Tensor, num_heads: int,
                     num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """q `[B, S, N, C]`, k `[B, S, G, C]` rotated and v `[B, S, G, C]`, contiguous (see `rope.rope_qkv`)."""
    b, s, r = qkv_BSR.shape
    per, c = _dims(r, num_heads, num_groups, cache, s)
    qkv, cs = qkv_BSR.contiguous(), cache.contiguous()
    q = qkv.new_empty((b, s, num_heads, c))
    k, v = qkv.new_empty((b, s, num_groups, c)), qkv.new_empty((b, s, num_groups, c))
    if b * s:
        grid = (triton.cdiv(b * s, BLOCK_T), num_groups)
        _rope_fwd_kernel[grid](qkv, cs, q, k, v, b * s, s, G=num_groups, PER=per, HALF=c // 2,
                               HP=triton.next_power_of_2(c // 2), BLOCK_T=BLOCK_T, num_warps=NUM_WARPS,
                               enable_fp_fusion=False)  # fmt: skip
    return q, k, v


def rope_qkv_backward(dq_BSNC: torch.Tensor, dk_BSGC: torch.Tensor, dv_BSGC: torch.Tensor, cache: torch.Tensor,
                      num_heads: int, num_groups: int) -> torch.Tensor:  # fmt: skip
    """dqkv `[B, S, R]` from the three grads (each with a unit stride over C; other strides any)."""
    b, s, _, c = dq_BSNC.shape
    per, _ = _dims((num_heads + 2 * num_groups) * c, num_heads, num_groups, cache, s)
    dq, dk, dv = (t if t.stride(-1) == 1 else t.contiguous() for t in (dq_BSNC, dk_BSGC, dv_BSGC))
    out = dq.new_empty((b, s, (num_heads + 2 * num_groups) * c))
    if b * s:
        grid = (triton.cdiv(b * s, BLOCK_T), num_groups)
        _rope_bwd_kernel[grid](dq, dk, dv, cache.contiguous(), out, b * s, s, *dq.stride()[:3], *dk.stride()[:3],
                               *dv.stride()[:3], G=num_groups, PER=per, HALF=c // 2,
                               HP=triton.next_power_of_2(c // 2), BLOCK_T=BLOCK_T, num_warps=NUM_WARPS,
                               enable_fp_fusion=False)  # fmt: skip
    return out
