"""MXFP8 against hand-computed vectors: the E8M0 scale choice (OCP floor and round-up), saturation,
all-zero and non-finite blocks, rowwise/columnwise copies.

OCP MX v1.0 section 6.3, E4M3 (emax_elem = 8): X = 2^(floor(log2 amax) - 8).
    amax 1.0   -> floor(log2) 0    -> X = 2^-8  (byte 119); 1.0 / X = 256
    amax 448   -> 8 (448 = 1.75*2^8) -> X = 1   (byte 127); 448 stays
    amax 500   -> 8                -> X = 1;   500 saturates to 448 (the OCP rule's known clip)
    amax 0.001 -> -10 (log2 = -9.97) -> X = 2^-18 (byte 109); 0.001 * 2^18 = 262.1 -> 256 (step 32)
    amax 0     -> byte 0 (2^-127), data 0
Round-up (arXiv 2506.08027, TE, Blackwell): X = 2^ceil(log2(amax * fl(1/448))).
    1.0 -> 2^-8; 448 -> 448 * fl(1/448) rounds to exactly 1.0 in fp32 -> X = 1; 500 -> X = 2 and
    500 / 2 = 250 -> 256 (step 16); 0.001 -> 2^-18.
"""

from __future__ import annotations

import math

import torch

from trainer.precision import MXFP8Recipe, Scheme, quantize
from trainer.precision.formats import e8m0_to_float

FLOOR = Scheme("mx", "e4m3", (1, 32))
RCEIL = Scheme("mx", "e4m3", (1, 32), mx_rounding="rceil")


def _blocks(amaxes: list[float]) -> torch.Tensor:
    """One row per amax: a 32-element block whose first element is the amax, the rest amax / 4."""
    x = torch.tensor(amaxes).unsqueeze(1).repeat(1, 32) / 4
    x[:, 0] = torch.tensor(amaxes)
    return x


def test_scale_choice_floor() -> None:
    q = quantize(_blocks([1.0, 448.0, 500.0, 0.001, 0.0]), FLOOR)
    assert q.rowwise.scale.shape == (5, 1)
    assert q.rowwise.scale.view(torch.uint8).flatten().tolist() == [119, 127, 127, 109, 0]
    assert e8m0_to_float(q.rowwise.scale).flatten().tolist() == [2.0**-8, 1.0, 1.0, 2.0**-18, 2.0**-127]
    assert q.rowwise.data[:, 0].float().tolist() == [256.0, 448.0, 448.0, 256.0, 0.0]
    deq = q.dequantize()
    assert deq[:, 0].tolist() == [1.0, 448.0, 448.0, 2.0**-10, 0.0]


def test_scale_choice_round_up() -> None:
    q = quantize(_blocks([1.0, 448.0, 500.0, 0.001, 0.0]), RCEIL)
    assert q.rowwise.scale.view(torch.uint8).flatten().tolist() == [119, 127, 128, 109, 0]
    assert q.rowwise.data[:, 0].float().tolist() == [256.0, 448.0, 256.0, 256.0, 0.0]
    assert q.dequantize()[2, 0].item() == 512.0  # no saturation, a coarser step instead


def test_e5m2_uses_emax_15() -> None:
    # E5M2 max is 1.75 * 2^15: amax 1.0 -> X = 2^-15 (byte 112); 1.0 / X = 32768.
    q = quantize(_blocks([1.0]), Scheme("mx", "e5m2", (1, 32)))
    assert q.rowwise.scale.view(torch.uint8).item() == 112
    assert q.rowwise.data[0, 0].float().item() == 32768.0


def test_all_zero_block_is_zero_with_a_defined_scale() -> None:
    x = torch.zeros(2, 64)
    x[0, 40] = 3.0  # second block of row 0 is non-zero; the other three blocks are all zero
    q = quantize(x, FLOOR, columnwise=True)
    assert q.rowwise.scale.view(torch.uint8).tolist() == [[0, 120], [0, 0]]  # 3: floor(log2)=1 -> 2^-7 = byte 120
    d = q.dequantize()
    assert not torch.isnan(d).any() and torch.equal(d, x)


def test_nonfinite_block_is_nan_and_others_untouched() -> None:
    x = torch.ones(1, 96)
    x[0, 3] = math.inf
    x[0, 40] = math.nan
    q = quantize(x, FLOOR)
    assert q.rowwise.scale.view(torch.uint8).tolist() == [[255, 255, 119]]
    d = q.dequantize()
    assert torch.isnan(d[0, :64]).all() and torch.equal(d[0, 64:], torch.ones(32))


def test_tiny_block_clamps_exponent() -> None:
    # amax 2^-140: floor(log2) - 8 = -148 is below E8M0's -127, so X = 2^-127 and 2^-140 / X = 2^-13,
    # below e4m3's smallest subnormal 2^-9: the block underflows to zero (nothing else is representable).
    x = torch.full((1, 32), 2.0**-140)
    q = quantize(x, FLOOR)
    assert q.rowwise.scale.view(torch.uint8).item() == 0
    assert torch.count_nonzero(q.rowwise.data.float()) == 0


def test_columnwise_copy_blocks_along_the_other_dim() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 96)
    x[:32, 5] *= 1000  # one huge column segment only affects its own 32x1 column block
    q = MXFP8Recipe().quantize_weight(x)
    assert q.rowwise.scale.shape == (64, 3) and q.columnwise.scale.shape == (96, 2)
    t = quantize(x.t().contiguous(), FLOOR)
    assert torch.equal(q.columnwise.data.view(torch.uint8), t.rowwise.data.view(torch.uint8))
    assert torch.equal(q.columnwise.scale.view(torch.uint8), t.rowwise.scale.view(torch.uint8))
    # Blocks of a column with the outlier get a large scale; the other half of that column does not.
    assert q.columnwise.scale.view(torch.uint8)[5, 0] > q.columnwise.scale.view(torch.uint8)[5, 1] + 5


def test_grouped_columnwise_needs_aligned_groups() -> None:
    x = torch.randn(64, 32)
    quantize(x, FLOOR, columnwise=True, offsets=torch.tensor([32, 64]))
    try:
        quantize(x, FLOOR, columnwise=True, offsets=torch.tensor([16, 64]))
    except ValueError as err:
        assert "multiple of 32" in str(err) and "align" in str(err)
    else:
        raise AssertionError("an unaligned token group was accepted")


def test_error_bound_random() -> None:
    # Every element is within half an e4m3 step of its block's scale grid, plus the saturated top:
    # relative error per element <= 2^-4 for values near the block max (3 mantissa bits).
    torch.manual_seed(1)
    x = torch.randn(128, 256) * torch.logspace(-3, 3, 256)
    for scheme in (FLOOR, RCEIL):
        d = quantize(x, scheme).dequantize()
        amax = x.abs().reshape(128, 8, 32).amax(-1, keepdim=True).expand(128, 8, 32).reshape(128, 256)
        assert ((d - x).abs() <= amax * 2.0**-3 + 1e-30).all()
        assert ((d - x).norm() / x.norm()).item() < 0.04
