"""fp8 blockwise (DeepSeek-V3 1x128 / 128x128, power-of-two fp32 scales) against hand-computed vectors."""

from __future__ import annotations

import torch

from trainer.precision import BlockwiseRecipe, Scheme, quantize

ACT = Scheme("block", "e4m3", (1, 128), pow2=True)
WEIGHT = Scheme("block", "e4m3", (128, 128), pow2=True)


def test_hand_vector_1x128_with_partial_block() -> None:
    # 130 columns: block 0 (128 values, amax 3) and a partial block 1 (2 values, amax 0.1).
    # scales: 448/3 -> pow2 128; 448/0.1 = 4480 -> pow2 4096.
    x = torch.zeros(1, 130)
    x[0, 0], x[0, 7] = 3.0, -1.0
    x[0, 128], x[0, 129] = 0.1, -0.05
    q = quantize(x, ACT)
    assert q.rowwise.scale.tolist() == [[1 / 128, 1 / 4096]]
    assert q.rowwise.data[0, [0, 7, 128, 129]].float().tolist() == [384.0, -128.0, 416.0, -208.0]


def test_128x128_tiles() -> None:
    # A 130x130 weight has a 2x2 tile grid; a single large value raises only its own tile's amax.
    w = torch.full((130, 130), 0.5)
    w[129, 2] = 7.0  # tile (1, 0)
    q = BlockwiseRecipe().quantize_weight(w)
    # 0.5 -> 448/0.5 = 896 -> pow2 512; 7 -> 64
    assert q.rowwise.scale.tolist() == [[1 / 512, 1 / 512], [1 / 64, 1 / 512]]
    assert q.columnwise.scale.tolist() == [[1 / 512, 1 / 64], [1 / 512, 1 / 512]]  # transposed grid
    t = quantize(w.t().contiguous(), WEIGHT)
    assert torch.equal(q.columnwise.data.view(torch.uint8), t.rowwise.data.view(torch.uint8))
    assert torch.equal(q.dequantize(), q.dequantize(copy="columnwise"))


def test_zero_block() -> None:
    q = quantize(torch.zeros(2, 256), ACT)
    assert q.rowwise.scale.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert torch.count_nonzero(q.dequantize()) == 0


def test_grouped_columnwise_alignment() -> None:
    recipe = BlockwiseRecipe()
    x = torch.randn(256, 64)
    q = recipe.quantize_activation(x, offsets=torch.tensor([128, 256]))
    alone = quantize(x[128:], ACT, columnwise=True)
    assert torch.equal(q.columnwise.data[:, 128:].view(torch.uint8), alone.columnwise.data.view(torch.uint8))
    try:
        recipe.quantize_activation(x, offsets=torch.tensor([64, 256]))
    except ValueError as err:
        assert "multiple of 128" in str(err)
    else:
        raise AssertionError("a token group not aligned to 128 was accepted")


def test_error_bound_random() -> None:
    torch.manual_seed(4)
    x = torch.randn(256, 256)
    for scheme in (ACT, WEIGHT):
        d = quantize(x, scheme).dequantize()
        assert ((d - x).norm() / x.norm()).item() < 0.04
