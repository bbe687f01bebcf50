"""Per-tensor FP8 on a shard: amax and quantize of a contiguous slice of a (grouped) weight.

The low-precision param gather of per-tensor recipes (fp8 `tensorwise`, `delayed`) has each rank quantize
its shard of the fp32 masters with the scale of the *whole* tensor (from an amax all-reduced over the
ranks), so that the gathered bytes are exactly the bytes of quantizing the whole tensor at once.

A shard is a flat run of elements `[first, first + n)` of a parameter, which may start and end anywhere.
A parameter has `slots` per-tensor scales: 1 for `[out, in]`, E for a grouped `[E, out, in]` (one per
expert, `per = numel / E` elements each), so element i belongs to slot `i // per`. Both functions cut the
run into at most three pieces (a partial first slot, whole slots, a partial last slot) and work on each in
one vectorised op: the cost does not grow with the number of experts (no per-expert loop).

Invariant (tested bitwise): for any cut of a tensor into shards, the max over shards of `shard_amax` is the
tensor's per-tensor amax, and the concatenated `quantize_shard` bytes equal `quantize(w, scheme,
amax=...)`'s rowwise data: the same formula `cast_to_fp8(x * encode_scale)` element by element.
"""

from __future__ import annotations

import torch

from .formats import cast_to_fp8, fp8_format
from .scheme import Scheme


def slot_runs(first: int, n: int, per: int) -> list[tuple[int, int, int, int]]:
    """Cut elements `[first, first + n)` at slot boundaries: `(start, stop, slot, count)` runs, run-local
    `[start, stop)`, covering `count` slots from `slot` (count > 1 only for whole slots)."""
    if per < 1:
        raise ValueError(f"slot size must be positive, got {per}")
    runs: list[tuple[int, int, int, int]] = []
    pos, end = first, first + n
    if pos % per and pos < end:  # partial first slot
        stop = min(end, (pos // per + 1) * per)
        runs.append((pos - first, stop - first, pos // per, 1))
        pos = stop
    whole = (end - pos) // per
    if whole:
        runs.append((pos - first, pos - first + whole * per, pos // per, whole))
        pos += whole * per
    if pos < end:  # partial last slot
        runs.append((pos - first, end - first, pos // per, 1))
    return runs


def shard_amax(x: torch.Tensor, first: int, per: int, slots: int) -> torch.Tensor:
    """max|x| per slot (fp32 `[slots]`, 0 where the run has no element) of the 1-D run `x` starting at
    element `first` of its tensor."""
    out = torch.zeros(slots, dtype=torch.float32, device=x.device)
    xf = x.detach().to(torch.float32)
    for a, b, slot, count in slot_runs(first, x.numel(), per):
        out[slot:slot + count] = xf[a:b].view(count, -1).abs().amax(dim=1)
    return out


def quantize_shard(x: torch.Tensor, first: int, per: int, encode_scale: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """FP8 values (1-D, `scheme`'s element dtype) of the run `x` starting at element `first`, each slot
    scaled by `encode_scale[slot]` (fp32 `[slots]`): TE's partial cast of a master shard."""
    if scheme.kind != "tensor":
        raise ValueError(f"shard quantization is for per-tensor scaling, not {scheme.describe()}")
    fmt = fp8_format(scheme.fmt)
    xf = x.detach().to(torch.float32)
    out = torch.empty(x.numel(), dtype=fmt.dtype, device=x.device)
    scale = encode_scale.to(torch.float32).reshape(-1)
    for a, b, slot, count in slot_runs(first, x.numel(), per):
        scaled = xf[a:b].view(count, -1) * scale[slot:slot + count].unsqueeze(1)
        out[a:b] = cast_to_fp8(scaled, fmt).reshape(-1)
    return out
