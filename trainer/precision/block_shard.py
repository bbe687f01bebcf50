"""Block-scaled FP8 on a shard: the block amaxes a shard touches, and its bytes under agreed block scales.

The blockwise FP8 param gather (fp8 `blockwise` with `fp8_param_gather`, as Megatron and TE gather
Float8BlockScaling params) has each rank look only at its shard of the fp32 masters, a flat run of
elements `[first, first + n)` of a weight `[..., M, K]` that may start and end anywhere, even inside a
row and a 128x128 block:

1. `shard_block_amax`: max |x| of every block the run touches (0 for blocks it does not touch), as one
   flat vector over the weight's block grid `[..., Mb, Kb]` (experts first for a grouped `[E, M, K]`);
2. the ranks take the elementwise MAX of those vectors (one all-reduce), which is every block's amax, and
   each computes the same scales from it (`scale_from_amax`, TE's rule, powers of two);
3. `quantize_block_shard`: the run's FP8 values, each element scaled by its own block's scale.

Invariant (tested bitwise for any cut): the max over shards of `shard_block_amax` is `block_amax` of the
whole weight, and the concatenated `quantize_block_shard` bytes are `quantize(w, scheme)`'s rowwise data:
the same formula `cast_to_fp8(x * scale[block])` element by element (kinds/block_fp8.py), with a partial
edge block scaled as if padded with zeros, which never raise an amax.

Both work on whole rows: the run is laid into the rows it overlaps (zeros outside it), so the cost is one
pass over at most n + 2K elements, whatever the number of blocks or experts (no per-block loop).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .blocks import num_blocks
from .formats import cast_to_fp8, fp8_format
from .scheme import Scheme


def block_grid(shape: torch.Size | tuple[int, ...], block: tuple[int, int]) -> tuple[int, int, int]:
    """(matrices, Mb, Kb) of a weight `[..., M, K]` in `block` tiles (matrices: the product of leading dims)."""
    *lead, M, K = shape
    mats = 1
    for d in lead:
        mats *= d
    return mats, num_blocks(M, block[0]), num_blocks(K, block[1])


def _rows(x: torch.Tensor, first: int, M: int, K: int, bh: int, Mb: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The run `x` (1-D, from element `first`) laid into the whole rows it overlaps, as fp32 `[R, K]` with
    zeros outside the run; the block-row index (over all matrices) of each of those rows; the run's offset
    in the first row."""
    n = x.numel()
    r0, r1 = first // K, (first + n - 1) // K + 1
    off = first - r0 * K
    buf = torch.zeros((r1 - r0) * K, dtype=torch.float32, device=x.device)
    buf[off:off + n] = x.detach().to(torch.float32)
    r = torch.arange(r0, r1, device=x.device)
    block_row = (r // M) * Mb + (r % M) // bh  # matrix-major: matrix e's block rows are e*Mb .. e*Mb+Mb-1
    return buf.view(r1 - r0, K), block_row, off


def _pad_cols(rows: torch.Tensor, Kb: int, bw: int) -> torch.Tensor:
    """`[R, K]` -> `[R, Kb, bw]`, zero padded on the right."""
    K = rows.shape[1]
    if Kb * bw != K:
        rows = F.pad(rows, (0, Kb * bw - K))
    return rows.view(rows.shape[0], Kb, bw)


def shard_block_amax(x: torch.Tensor, first: int, shape: torch.Size | tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """max |x| per block of the weight `shape` over the run `x` starting at element `first`: fp32, flat over
    the block grid `[..., Mb, Kb]`, 0 where the run has no element. NaN propagates."""
    mats, Mb, Kb = block_grid(shape, block)
    bh, bw = block
    M, K = shape[-2], shape[-1]
    out = torch.zeros(mats * Mb, Kb, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return out.view(-1)
    rows, block_row, _ = _rows(x, first, M, K, bh, Mb)
    per_row = _pad_cols(rows.abs(), Kb, bw).amax(dim=-1)  # [R, Kb]
    out.scatter_reduce_(0, block_row.unsqueeze(1).expand_as(per_row), per_row, reduce="amax", include_self=True)
    return out.view(-1)


def quantize_block_shard(x: torch.Tensor, first: int, shape: torch.Size | tuple[int, ...], encode_scale: torch.Tensor,
                         scheme: Scheme) -> torch.Tensor:  # fmt: skip
    """FP8 values (1-D, `scheme`'s element dtype) of the run `x` starting at element `first` of a weight
    `shape`, each element scaled by its block's `encode_scale` (fp32, flat over the block grid)."""
    if scheme.kind != "block":
        raise ValueError(f"block shard quantization is for block scaling, not {scheme.describe()}")
    fmt = fp8_format(scheme.fmt)
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=fmt.dtype, device=x.device)
    mats, Mb, Kb = block_grid(shape, scheme.block)
    bh, bw = scheme.block
    M, K = shape[-2], shape[-1]
    rows, block_row, off = _rows(x, first, M, K, bh, Mb)
    scale = encode_scale.to(torch.float32).reshape(mats * Mb, Kb)[block_row]  # [R, Kb]
    scaled = _pad_cols(rows, Kb, bw) * scale.unsqueeze(-1)
    q = cast_to_fp8(scaled, fmt).view(rows.shape[0], Kb * bw)[:, :K]
    return q.reshape(-1)[off:off + n]
