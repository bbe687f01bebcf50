"""`precision/block_shard.py`: for any cut of a weight into shards, the max over shards of the block amaxes is
the weight's, and the shards' bytes under those scales are the recipe's quantization of the whole weight."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.kernels.fp8_scale import scale_from_amax
from trainer.precision.block_shard import block_grid, quantize_block_shard, shard_block_amax
from trainer.precision.blocks import block_amax
from trainer.precision.quantize import quantize
from trainer.precision.recipes import BlockwiseRecipe

SCHEME = BlockwiseRecipe().weight_scheme()


@pytest.mark.parametrize("shape", [(256, 128), (192, 256), (3, 200, 130), (2, 64, 300), (128, 128)])
@pytest.mark.parametrize("seed", [0, 1])
def test_any_cut_gives_the_whole_weights_amaxes_and_bytes(shape: tuple[int, ...], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])).to(torch.bfloat16)
    n = w.numel()
    # ragged cuts: inside rows and blocks, plus a one-element shard and an empty one
    cuts = sorted({0, 1, n // 2, n // 2, n - 1, n, *torch.randint(1, n, (4,), generator=g).tolist()})
    flat = w.reshape(-1)
    amax = torch.zeros(math.prod(block_grid(shape, SCHEME.block)))
    for a, b in zip(cuts, cuts[1:]):
        amax = torch.maximum(amax, shard_block_amax(flat[a:b], a, shape, SCHEME.block))
    assert torch.equal(amax, block_amax(w.float(), *SCHEME.block).reshape(-1))
    scale = scale_from_amax(amax, 448.0, pow2=True)
    got = torch.cat([quantize_block_shard(flat[a:b], a, shape, scale, SCHEME) for a, b in zip(cuts, cuts[1:])])
    want = quantize(w, SCHEME, rowwise=True, columnwise=False).rowwise
    assert torch.equal(got.view(torch.uint8), want.data.reshape(-1).view(torch.uint8))
    assert torch.equal(torch.reciprocal(scale).view(want.scale.shape), want.scale)


def test_a_shard_reports_only_the_blocks_it_touches() -> None:
    shape = (2, 256, 256)  # 2 experts x 2 x 2 blocks
    w = torch.ones(shape)
    first = 128 * 256 + 5  # expert 0, block row 1, inside the first block
    a = shard_block_amax(w.reshape(-1)[first:first + 130], first, shape, SCHEME.block).view(2, 2, 2)
    assert a.tolist() == [[[0, 0], [1, 1]], [[0, 0], [0, 0]]]
    assert shard_block_amax(w.reshape(-1)[:0], 0, shape, SCHEME.block).abs().sum() == 0


def test_only_block_schemes() -> None:
    from trainer.precision.recipes import TensorwiseRecipe

    with pytest.raises(ValueError, match="block scaling"):
        quantize_block_shard(torch.ones(4), 0, (2, 2), torch.ones(1), TensorwiseRecipe().weight_scheme())
