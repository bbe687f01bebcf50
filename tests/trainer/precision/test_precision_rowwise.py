"""fp8 rowwise (per-row scales along the contraction dim, powers of two) against hand-computed vectors."""

from __future__ import annotations

import torch

from trainer.precision import RowwiseRecipe, Scheme, quantize

ROW = Scheme("row", "e4m3", pow2=True)


def test_hand_vector() -> None:
    # row 0: amax 3 -> 448/3 = 149.3 -> pow2 128: [128, -384]
    # row 1: amax 0.1 -> 4480 -> pow2 4096: 0.1*4096 = 409.6 -> 416 (step 32); 0.05*4096 = 204.8 -> 208 (step 16)
    x = torch.tensor([[1.0, -3.0], [0.1, 0.05]])
    q = quantize(x, ROW)
    assert q.rowwise.data.float().tolist() == [[128.0, -384.0], [416.0, 208.0]]
    assert q.rowwise.scale.tolist() == [[1 / 128], [1 / 4096]]
    assert q.dequantize().tolist() == [[1.0, -3.0], [416 / 4096, 208 / 4096]]


def test_zero_row_and_columnwise() -> None:
    x = torch.tensor([[0.0, 0.0], [2.0, -1.0]])
    q = quantize(x, ROW, columnwise=True)
    assert q.rowwise.scale.tolist() == [[1.0], [1 / 128]]  # zero row: unit scale; 448/2 = 224 -> 128
    # columnwise: x^T rows [0, 2] and [0, -1]: amax 2 -> 128, amax 1 -> 256
    assert q.columnwise.scale.tolist() == [[1 / 128], [1 / 256]]
    assert q.columnwise.data.float().tolist() == [[0.0, 256.0], [0.0, -256.0]]


def test_grouped_columnwise_scales_per_feature_and_group() -> None:
    torch.manual_seed(0)
    x = torch.randn(48, 16)
    x[16:32, 3] = 100.0
    offs = torch.tensor([16, 32, 48])
    q = RowwiseRecipe().quantize_activation(x, offsets=offs)
    assert q.columnwise.scale.shape == (16, 3)  # [D, G]
    for g, (s, e) in enumerate([(0, 16), (16, 32), (32, 48)]):
        alone = quantize(x[s:e], ROW, columnwise=True)
        assert torch.equal(q.columnwise.scale[:, g : g + 1], alone.columnwise.scale)
        assert torch.equal(q.columnwise.data[:, s:e].view(torch.uint8), alone.columnwise.data.view(torch.uint8))
        assert torch.equal(q.rowwise.data[s:e].view(torch.uint8), alone.rowwise.data.view(torch.uint8))


def test_error_bound_random() -> None:
    torch.manual_seed(3)
    x = torch.randn(64, 96) * torch.logspace(-2, 2, 64).unsqueeze(1)
    d = quantize(x, ROW).dequantize()
    # each row is within 2^-4 of its own amax scale grid (3 mantissa bits), whatever its magnitude
    assert ((d - x).abs() <= x.abs().amax(1, keepdim=True) * 2.0**-4).all()
