"""NVFP4 against a hand-computed vector: global scale, E4M3 block scales, E2M1 codes, packing.

One row of 48 values = three 1x16 blocks; tensor amax 42, so S_enc = 448*6 / 42 = 64 exactly and the
global decode scale is 1/64. In fp32, S_enc * fl(1/6) = fl(64/6) = 10.666667 (exact scaling by 64).
    block A (amax 42):  42 * 10.666667 = 448.0000134 -> fp32 448 -> e4m3 448; enc = 1/(448/64) = fl(1/7)
        42 -> 6.0000005 -> clamp 6 (code 7)      14 -> 2.0000001 -> 2 (code 4)   10.5 -> 1.5 (code 3)
       -21 -> -3 (code 13)                       17 -> 2.43 -> 2 (code 4)
        dequantize: q * 448 / 64 = q * 7  ->  42, 14, 10.5, -21, 14
    block B (amax 3):   3 * 10.666667 = 32.000001 -> fp32 32 -> e4m3 32; enc = 1/(32/64) = 2
        3 -> 6 (7)   1.25 -> 2.5 tie -> 2 (4)   0.3 -> 0.6 -> 0.5 (1)   -1.75 -> -3.5 tie -> -4 (14)
        0.125 -> 0.25 tie -> 0 (0);  dequantize q * 32 / 64 = q / 2 -> 3, 1, 0.25, -2, 0
    block C (all zero): block scale 0, codes 0, dequantizes to 0 (no NaN).
"""

from __future__ import annotations

import math

import torch

from trainer.precision import NVFP4Recipe, Scheme, quantize
from trainer.precision.fp4 import unpack_e2m1
from trainer.precision.kinds.nvfp4 import global_encode_scale

ACT = Scheme("nvfp4", "e2m1", (1, 16))
WEIGHT = Scheme("nvfp4", "e2m1", (16, 16))


def _hand_row() -> torch.Tensor:
    x = torch.zeros(1, 48)
    x[0, :5] = torch.tensor([42.0, 14.0, 10.5, -21.0, 17.0])
    x[0, 16:21] = torch.tensor([3.0, 1.25, 0.3, -1.75, 0.125])
    return x


def test_hand_vector() -> None:
    q = quantize(_hand_row(), ACT)
    assert q.rowwise.global_scale.item() == 1 / 64
    assert q.rowwise.scale.dtype == torch.float8_e4m3fn
    assert q.rowwise.scale.float().tolist() == [[448.0, 32.0, 0.0]]
    codes = unpack_e2m1(q.rowwise.data)
    assert codes[0, :5].tolist() == [7, 4, 3, 13, 4]
    assert codes[0, 16:21].tolist() == [7, 4, 1, 14, 0]
    assert torch.count_nonzero(codes[0, 32:]) == 0
    # packing: codes (7, 4) -> byte 0x47, (1, 14) -> 0xE1
    assert q.rowwise.data[0, 8:10].tolist() == [0x47, 0xE1]
    d = q.dequantize()
    assert d[0, :5].tolist() == [42.0, 14.0, 10.5, -21.0, 14.0]
    assert d[0, 16:21].tolist() == [3.0, 1.0, 0.25, -2.0, 0.0]
    assert not torch.isnan(d).any() and torch.count_nonzero(d[0, 32:]) == 0


def test_global_scale_rule() -> None:
    s = global_encode_scale(torch.tensor([42.0, 0.0, math.inf, math.nan, 1e-40]))
    assert s[:4].tolist() == [64.0, 1.0, 1.0, 1.0]  # zero / inf / NaN amax -> 1
    assert s[4].item() == torch.finfo(torch.float32).max  # 2688 / 1e-40 overflows -> FLT_MAX


def test_all_zero_tensor() -> None:
    q = quantize(torch.zeros(16, 32), WEIGHT, columnwise=True)
    assert q.rowwise.global_scale.item() == 1.0
    assert torch.equal(q.dequantize(), torch.zeros(16, 32))


def test_saturation_and_nan() -> None:
    x = torch.ones(1, 32)
    x[0, 0] = math.inf
    q = quantize(x, ACT)
    # inf -> tensor amax inf -> S_enc 1. Block 0: scale inf clamps to 448, inf * (1/448) clamps to 6.
    # Block 1 (amax 1): 1 * fl(1/6) = 0.1667 -> e4m3 0.171875 (step 2^-6 in [0.125, 0.25)).
    assert q.rowwise.scale.float().tolist() == [[448.0, 0.171875]]
    assert unpack_e2m1(q.rowwise.data)[0, :2].tolist() == [7, 0]
    x = torch.ones(1, 32)
    x[0, 20] = math.nan
    d = quantize(x, ACT).dequantize()
    assert torch.isnan(d[0, 16:]).all()  # the NaN's block is NaN ...
    assert not torch.isnan(d[0, :16]).any()  # ... the other block is not


def test_2d_tiles_share_one_scale_and_transpose_exactly() -> None:
    torch.manual_seed(0)
    w = torch.randn(32, 48)
    w[:16, :16] *= 10
    q = NVFP4Recipe(None).quantize_weight(w)
    assert q.rowwise.scale.shape == (2, 3) and q.columnwise.scale.shape == (3, 2)
    t = quantize(w.t().contiguous(), WEIGHT)
    assert torch.equal(q.columnwise.data, t.rowwise.data)
    assert torch.equal(q.columnwise.scale.view(torch.uint8), t.rowwise.scale.view(torch.uint8))
    assert torch.equal(q.dequantize(copy="columnwise"), q.dequantize())  # same values both ways


def test_grouped_activation_global_scale_per_group() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    x[32:] *= 40
    offs = torch.tensor([32, 64])
    q = NVFP4Recipe(None).quantize_activation(x, offsets=offs)
    for g, (s, e) in enumerate([(0, 32), (32, 64)]):
        alone = quantize(x[s:e], ACT, columnwise=True)
        assert q.rowwise.global_scale[g].item() == alone.rowwise.global_scale.item()
        assert torch.equal(q.rowwise.data[s:e], alone.rowwise.data)
        assert torch.equal(q.columnwise.data[:, s // 2 : e // 2], alone.columnwise.data)


def test_error_bound_random() -> None:
    torch.manual_seed(2)
    x = torch.randn(64, 128)
    for scheme in (ACT, WEIGHT):
        d = quantize(x, scheme).dequantize()
        assert ((d - x).norm() / x.norm()).item() < 0.15


def test_block_scale_multiply_order_is_tes() -> None:
    # TE computes amax_block * (S_enc * fl(1/6)). With S_enc = 64 (tensor amax 42) and a block amax of
    # b = 1.78125 - 2^-23: b * fl(64/6) = 18.99999932 rounds to fp32 19.0, a tie in e4m3 between 18 and 20
    # -> 20 (even mantissa). The other order, fl(b / 6) * 64 = 18.999998, would give 18.
    x = torch.zeros(1, 32)
    x[0, 0] = 42.0
    x[0, 16] = 1.78125 - 2.0**-23
    q = quantize(x, ACT)
    assert q.rowwise.scale.float().tolist() == [[448.0, 20.0]]
