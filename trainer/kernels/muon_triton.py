"""Triton kernels for Muon's elementwise work around Newton-Schulz (CUDA, low-precision iteration).

`muon_batch.muon_step_` runs, per matrix, the momentum EMA, the Nesterov blend cast into its slot of the
Newton-Schulz batch, the per-slice Frobenius normalisation, and after the iteration the weight decay and the
scaled update of the fp32 master. As torch ops that is seven passes over fp32 and bf16 tensors (clip, lerp_,
lerp, norm, div, mul_, add_): 44 bytes per element, about 37 ms per step of the 1.83B reference model on an
H100 against the iteration's 70 ms of GEMMs (profile in docs/benchmarks.md). Here it is three passes:

- `blend_`: reads grad and momentum (fp32), writes the momentum and the blend (in the batch's dtype) and each
  block's sum of squares of the rounded blend (`slice_sums` adds a slice's blocks with one torch reduction:
  no atomics, so a step is bit-reproducible, as the graph == eager and dp tests require): 14 B/element;
- `normalize_`: divides each slice of the batch by `sqrt(sumsq) + eps` in place: 4 B/element (bf16);
- `apply_`: `master = master * decay + alpha * ortho`: 10 B/element; with `publish`, the updated master is also
  written, cast, into the param's bf16 buffer range that staging would copy it to (`muon_batch.MuonMatrix.publish`):
  12 B/element where apply and a separate staging copy take 16.

Same formulas as the torch path, in fp32 registers, with torch's `lerp` branch (`w < 0.5: a + w (b - a)`, else
`b - (b - a)(1 - w)`); the grad is multiplied by the clip coefficient first, as `grad_norm.clipped` does (not
written back: nothing reads a Muon grad after the step). Not bitwise the torch path: the sum of squares is
accumulated in another (fixed) order and kept in fp32 where `vector_norm` of a bf16 batch rounds the norm to bf16
(tested within a stated tolerance, tests/trainer/kernels/test_muon_triton.py).

The grad, the momentum and the master (fp32) and the published param (bf16) may also be row-block views
instead of contiguous: `[G, r, n]` blocks of whole rows, as `muon.qkv_parts` cuts a fused QKV weight into its
query, key and value parts across the query groups. Each program then reads and writes those tensors at its
block's place in the view (`kernels/block_table.py`: BLOCK-element blocks, so each r x n row block must be
whole blocks) and the batch slot, whose rows the blocks stack into, in order: one launch per part, the same
per-element math.

Imported lazily on CUDA only; importing it needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainer.kernels import block_table

BLOCK = 4096  # elements per program: every slice of the shipped shapes is a multiple (checked by `fits`)
# Offsets are int64 throughout: one grouped expert weight may hold more than 2^31 elements (256 x 7168 x 2048).


def fits(slice_elems: int) -> bool:
    """Whether slices of `slice_elems` elements tile into whole blocks (a block never spans two slices)."""
    return slice_elems % BLOCK == 0


def takes(t: torch.Tensor) -> bool:
    """Whether the fused kernels take `t` as a grad, momentum, master or published param: contiguous, or a
    row-block view of whole blocks (`block_table`)."""
    return block_table.takes(t, BLOCK)


@triton.jit
def _lerp(a, b, w):
    """torch's lerp: a + w (b - a) for w < 0.5, else b - (b - a)(1 - w) (exact at both ends)."""
    if w < 0.5:
        return a + w * (b - a)
    return b - (b - a) * (1.0 - w)


@triton.jit
def _blend_kernel(g_ptr, m_ptr, out_ptr, partial_ptr, table_ptr, block0, coef, coef_ptr, skip_ptr, beta,
                  NESTEROV: tl.constexpr, COEF_ON_DEVICE: tl.constexpr, SKIP: tl.constexpr, TABLE: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    src = offs  # grad and momentum: the block's place in a row-block view, else the slot's
    if TABLE:
        src = tl.load(table_ptr + pid) * BLOCK + tl.arange(0, BLOCK)
    if COEF_ON_DEVICE:
        coef = tl.load(coef_ptr)
    g = tl.load(g_ptr + src).to(tl.float32) * coef
    m = _lerp(tl.load(m_ptr + src), g, 1.0 - beta)
    if SKIP:  # a non-finite step: the momentum stays as it was (the blend is computed, and never applied)
        tl.store(m_ptr + src, m, mask=(src >= 0) & (tl.load(skip_ptr) == 0.0))
    else:
        tl.store(m_ptr + src, m)
    u = m
    if NESTEROV:
        u = _lerp(g, m, beta)
    u = u.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, u)
    uf = u.to(tl.float32)
    tl.store(partial_ptr + block0 + pid, tl.sum(uf * uf, axis=0))


@triton.jit
def _normalize_kernel(x_ptr, sumsq_ptr, eps, SLICE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    norm = tl.sqrt(tl.load(sumsq_ptr + (pid.to(tl.int64) * BLOCK) // SLICE)) + eps
    x = tl.load(x_ptr + offs).to(tl.float32) / norm
    tl.store(x_ptr + offs, x.to(x_ptr.dtype.element_ty))


@triton.jit
def _apply_kernel(p_ptr, o_ptr, q_ptr, skip_ptr, table_ptr, decay, alpha, PUBLISH: tl.constexpr, SKIP: tl.constexpr,
                  TABLE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    dst = offs  # master and param: the block's place in a row-block view, else the update's
    if TABLE:
        dst = tl.load(table_ptr + pid) * BLOCK + tl.arange(0, BLOCK)
    keep = dst >= 0
    if SKIP:  # a non-finite step: the master and the param stay as they were
        keep = keep & (tl.load(skip_ptr) == 0.0)
    p = tl.load(p_ptr + dst) * decay
    p = p + alpha * tl.load(o_ptr + offs).to(tl.float32)
    tl.store(p_ptr + dst, p, mask=keep)
    if PUBLISH:  # round to nearest even, as staging's `copy_` casts
        tl.store(q_ptr + dst, p.to(q_ptr.dtype.element_ty), mask=keep)


def blend_(grad: torch.Tensor, momentum: torch.Tensor, out: torch.Tensor, partials: torch.Tensor, first_block: int,
           *, coef: float | torch.Tensor, beta: float, nesterov: bool, skip: torch.Tensor | None = None) -> None:
    """`momentum.lerp_(grad * coef, 1 - beta)`; `out` = the Nesterov blend (or the momentum) in its dtype;
    `partials[first_block + b]` = the sum of squares of block b of `out` (BLOCK elements; `slice_sums` turns
    them into per-slice sums). Of one element count that is whole slices of `out`'s trailing `[m, n]` (`fits`);
    `out` contiguous, grad and momentum contiguous or both one row-block view (the module docstring).

    The device verdict (`grad_norm.GradVerdict`) may stay on the device: `coef` an fp32 scalar tensor read by
    the kernel, `skip` an fp32 scalar (`found_inf`) that, when 1, leaves the momentum unwritten."""
    n, slice_elems = out.numel(), out.shape[-2] * out.shape[-1]
    if not out.is_contiguous():
        raise ValueError("Muon's fused blend needs a contiguous output")
    table = block_table.block_table(grad, BLOCK)  # grad and momentum contiguous, or one row-block layout
    block_table.same_layout("blend", grad, momentum)
    if grad.numel() != n or momentum.numel() != n or momentum.dtype != torch.float32 or not fits(slice_elems):
        raise ValueError(f"Muon's fused blend: {grad.numel()}/{momentum.numel()}/{n} elements, slices of {slice_elems}")
    if partials.dtype != torch.float32 or first_block + n // BLOCK > partials.numel():
        raise ValueError(f"Muon's fused blend: {partials.numel()} partial sums, blocks {first_block}+{n // BLOCK}")
    on_device = isinstance(coef, torch.Tensor)
    _check_scalar("blend", "coef", coef if on_device else None, out.device)
    _check_scalar("blend", "skip", skip, out.device)
    coef_ptr = coef if on_device else partials  # not read unless COEF_ON_DEVICE
    _blend_kernel[(n // BLOCK,)](grad, momentum, out, partials, partials if table is None else table, first_block,
                                 1.0 if on_device else coef, coef_ptr, partials if skip is None else skip, beta,
                                 NESTEROV=nesterov, COEF_ON_DEVICE=on_device, SKIP=skip is not None,
                                 TABLE=table is not None, BLOCK=BLOCK, num_warps=8)  # fmt: skip


def _check_scalar(kernel: str, name: str, t: torch.Tensor | None, device: torch.device) -> None:
    """A device-verdict input (`coef`, `skip`), if given, is one fp32 element on the kernel's device."""
    if t is not None and (t.numel() != 1 or t.dtype != torch.float32 or t.device != device):
        raise ValueError(f"Muon's fused {kernel}: {name} must be one fp32 element on {device}")


def slice_sums(partials: torch.Tensor, slice_elems: int) -> torch.Tensor:
    """Per-slice sums of squares from `blend_`'s per-block partials (fp32; a fixed-order torch reduction)."""
    return partials.view(-1, slice_elems // BLOCK).sum(dim=1)


def normalize_(X: torch.Tensor, sumsq: torch.Tensor, eps: float) -> None:
    """Each trailing `[m, n]` slice of contiguous `X` divided by `sqrt(sumsq[slice]) + eps`, in place."""
    slice_elems = X.shape[-2] * X.shape[-1]
    if not X.is_contiguous() or not fits(slice_elems) or sumsq.numel() != X.numel() // slice_elems:
        raise ValueError(f"Muon's fused normalise: shape {tuple(X.shape)}, {sumsq.numel()} sums")
    _normalize_kernel[(X.numel() // BLOCK,)](X, sumsq, eps, SLICE=slice_elems, BLOCK=BLOCK, num_warps=8)


def apply_(master: torch.Tensor, ortho: torch.Tensor, *, decay: float, alpha: float,
           publish: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
    """`master = master * decay + alpha * ortho` in place (fp32 master, contiguous or a row-block view, whole
    blocks; `ortho` contiguous); `publish` (laid out as the master): also receives the new master cast to its
    dtype. `skip` (one fp32 element on the device, `found_inf`): when 1, neither the master nor `publish` is
    written."""
    n = master.numel()
    if not ortho.is_contiguous() or ortho.numel() != n or n % BLOCK:
        raise ValueError(f"Muon's fused apply: master {tuple(master.shape)}, update {tuple(ortho.shape)}")
    table = block_table.block_table(master, BLOCK)  # master and publish contiguous, or one row-block layout
    if publish is not None:
        block_table.same_layout("apply", master, publish)
    _check_scalar("apply", "skip", skip, master.device)
    _apply_kernel[(n // BLOCK,)](master, ortho, master if publish is None else publish,
                                 master if skip is None else skip, master if table is None else table, decay, alpha,
                                 PUBLISH=publish is not None, SKIP=skip is not None, TABLE=table is not None,
                                 BLOCK=BLOCK, num_warps=8)  # fmt: skip
