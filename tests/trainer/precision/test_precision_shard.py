"""Per-tensor FP8 on shards (`trainer/precision/shard.py`): any cut of a (grouped) weight into shards
gives, bitwise, the amax and the bytes of quantizing the whole weight at once (the param-gather invariant)."""

from __future__ import annotations

import pytest
import torch

from trainer.precision import TensorwiseRecipe
from trainer.kernels.fp8_scale import scale_from_amax
from trainer.precision.formats import E4M3
from trainer.precision.kinds.per_tensor import tensor_amax
from trainer.precision.shard import quantize_shard, shard_amax, slot_runs


def test_slot_runs_cut_at_slot_boundaries() -> None:
    assert slot_runs(0, 12, 4) == [(0, 12, 0, 3)]
    assert slot_runs(2, 12, 4) == [(0, 2, 0, 1), (2, 10, 1, 2), (10, 12, 3, 1)]
    assert slot_runs(5, 2, 4) == [(0, 2, 1, 1)]  # inside one slot
    assert slot_runs(3, 1, 4) == [(0, 1, 0, 1)]
    assert slot_runs(4, 0, 4) == []
    with pytest.raises(ValueError):
        slot_runs(0, 1, 0)


@pytest.mark.parametrize("shape", [(3, 8, 16), (24, 20)], ids=["grouped", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shards_reproduce_the_whole_tensor_bitwise(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[0]).view(-1, *[1] * (len(shape) - 1))).to(dtype)
    w.view(-1)[7] = 0.0
    recipe = TensorwiseRecipe()
    scheme = recipe.weight_scheme()
    whole = recipe.quantize_weight(w, columnwise=False)
    slots = shape[0] if len(shape) == 3 else 1
    per = w.numel() // slots
    flat = w.reshape(-1)
    cuts = [0, 5, 6, per - 1, per + 3, 2 * per + 1, w.numel()] if slots > 1 else [0, 1, 200, w.numel()]
    cuts = sorted(set(min(c, w.numel()) for c in cuts))
    pieces = list(zip(cuts[:-1], cuts[1:]))
    amax = torch.zeros(slots)
    for a, b in pieces:
        amax = torch.maximum(amax, shard_amax(flat[a:b], a, per, slots))
    torch.testing.assert_close(amax.reshape(shape[:-2]), tensor_amax(w.float(), None), rtol=0, atol=0)
    scale = scale_from_amax(amax, E4M3.max)
    data = torch.cat([quantize_shard(flat[a:b], a, per, scale, scheme) for a, b in pieces])
    assert torch.equal(data.view(torch.uint8), whole.rowwise.data.reshape(-1).view(torch.uint8))
    assert torch.equal(torch.reciprocal(scale).reshape(shape[:-2]), whole.rowwise.scale)


def test_quantize_shard_refuses_block_scaling() -> None:
    from trainer.precision import MXFP8Recipe

    with pytest.raises(ValueError, match="per-tensor"):
        quantize_shard(torch.ones(4), 0, 4, torch.ones(1), MXFP8Recipe().weight_scheme())
