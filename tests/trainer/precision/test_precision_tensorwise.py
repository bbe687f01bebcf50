"""Per-tensor FP8 (tensorwise current scaling, delayed scaling) against hand-computed vectors.

Scale rule (TE compute_scale_from_amax): scale = 448 / amax; 1 for amax 0, inf or NaN; data =
sat_rne(x * scale); stored decode scale = 1 / scale.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.precision import DelayedRecipe, Scheme, TensorwiseRecipe, quantize
from trainer.kernels.fp8_scale import scale_from_amax

E4M3_TENSOR = Scheme("tensor", "e4m3")


def test_hand_vector_exact_scale() -> None:
    # amax 3.5 -> scale 448 / 3.5 = 128 exactly. x * 128 = [128, -256, 448, 38.4]; 38.4 lies in [32, 64)
    # where e4m3's step is 4: nearest 40. Decode scale 1/128.
    x = torch.tensor([[1.0, -2.0], [3.5, 0.3]])
    q = quantize(x, E4M3_TENSOR)
    assert q.rowwise.data.float().tolist() == [[128.0, -256.0], [448.0, 40.0]]
    assert q.rowwise.scale.item() == 1 / 128
    assert q.dequantize().tolist() == [[1.0, -2.0], [3.5, 0.3125]]


def test_hand_vector_inexact_scale() -> None:
    # amax 3 -> scale fl32(448/3) = 149.33333; 1 -> 149.3 -> 144 (step 16 in [128, 256));
    # -2 -> -298.7 -> -288 (step 32); 3 -> 448; 0.5 -> 74.7 -> 72 (step 8 in [64, 128)).
    x = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    q = quantize(x, E4M3_TENSOR)
    assert q.rowwise.data.float().tolist() == [[144.0, -288.0], [448.0, 72.0]]
    assert q.rowwise.scale.item() == pytest.approx(3 / 448, rel=1e-7)


def test_scale_rule_edge_cases() -> None:
    amax = torch.tensor([0.0, math.inf, math.nan, 1e-45, 448.0, 3.0])
    s = scale_from_amax(amax, 448.0)
    assert s[:3].tolist() == [1.0, 1.0, 1.0]  # zero / inf / NaN amax -> unit scale
    assert s[3].item() == torch.finfo(torch.float32).max  # 448 / 1e-45 overflows -> FLT_MAX
    assert s[4].item() == 1.0
    # pow2 rounds down: 448/3 = 149.3 -> 128
    assert scale_from_amax(torch.tensor([3.0]), 448.0, pow2=True).item() == 128.0


def test_all_zero_tensor_gives_zeros_and_unit_scale() -> None:
    q = quantize(torch.zeros(4, 8), E4M3_TENSOR, columnwise=True)
    assert q.rowwise.scale.item() == 1.0
    assert torch.count_nonzero(q.rowwise.data.float()) == 0
    assert not torch.isnan(q.dequantize()).any()


def test_nonfinite_policy() -> None:
    # inf makes amax inf -> scale 1: inf saturates to 448, finite values are cast as they are;
    # NaN makes amax NaN -> scale 1: the NaN element stays NaN.
    q = quantize(torch.tensor([[math.inf, 1.0], [-2.0, 0.0]]), E4M3_TENSOR)
    assert q.rowwise.data.float().tolist() == [[448.0, 1.0], [-2.0, 0.0]]
    q = quantize(torch.tensor([[math.nan, 1.0], [-2.0, 0.0]]), E4M3_TENSOR)
    d = q.dequantize()
    assert math.isnan(d[0, 0].item()) and d[0, 1].item() == 1.0 and d[1, 0].item() == -2.0


def test_saturation_with_a_given_scale() -> None:
    # An encode scale (as delayed scaling supplies) too large for the data saturates at 448.
    q = quantize(torch.tensor([[3.5, -1.0]]), E4M3_TENSOR, encode_scale=torch.tensor(256.0))
    assert q.rowwise.data.float().tolist() == [[448.0, -256.0]]
    assert q.dequantize().tolist() == [[1.75, -1.0]]


def test_amax_override_is_used() -> None:
    # A sharded param quantized with the amax of the whole param (all-reduced), not its own.
    q = quantize(torch.tensor([[1.0, 0.5]]), E4M3_TENSOR, amax=torch.tensor(3.5))
    assert q.rowwise.scale.item() == 1 / 128 and q.rowwise.data.float().tolist() == [[128.0, 64.0]]


def test_grouped_weight_has_one_scale_per_expert() -> None:
    w = torch.randn(3, 16, 32)
    w[1] *= 100
    q = TensorwiseRecipe().quantize_weight(w)
    assert q.rowwise.scale.shape == (3,)
    for e in range(3):
        alone = quantize(w[e], E4M3_TENSOR, columnwise=True)
        assert torch.equal(q.expert(e).to_bytes(), alone.to_bytes())


def test_grouped_activation_has_one_scale_per_token_group() -> None:
    x = torch.randn(40, 16)
    x[16:24] *= 50
    offs = torch.tensor([16, 24, 24, 40])  # the third group is empty
    q = quantize(x, E4M3_TENSOR, columnwise=True, offsets=offs)
    assert q.rowwise.scale.shape == (4,) and q.rowwise.scale[2].item() == 1.0
    starts = [0, 16, 24, 24]
    for g, (s, e) in enumerate(zip(starts, offs.tolist())):
        if e == s:
            continue
        alone = quantize(x[s:e], E4M3_TENSOR, columnwise=True)
        assert torch.equal(q.rowwise.data[s:e].view(torch.uint8), alone.rowwise.data.view(torch.uint8))
        assert torch.equal(q.columnwise.data[:, s:e].view(torch.uint8), alone.columnwise.data.view(torch.uint8))
        assert q.rowwise.scale[g].item() == alone.rowwise.scale.item()


def test_delayed_scaling_history() -> None:
    recipe = DelayedRecipe(history_len=2)
    state = recipe.new_state()
    x1 = torch.tensor([[3.5, -1.0]])
    q1 = recipe.quantize_activation(x1, state=state, columnwise=False)
    assert q1.rowwise.scale.item() == 1.0  # empty history: unit scale, 3.5 stays 3.5
    assert q1.rowwise.data.float().tolist() == [[3.5, -1.0]]
    x2 = torch.tensor([[7.0, 1.0]])
    q2 = recipe.quantize_activation(x2, state=state, columnwise=False)
    # scale from history max 3.5 -> 128: 7 * 128 = 896 saturates to 448 (the delayed-scaling trade)
    assert q2.rowwise.scale.item() == 1 / 128 and q2.rowwise.data.float().tolist() == [[448.0, 128.0]]
    q3 = recipe.quantize_activation(torch.zeros(1, 2), state=state, columnwise=False)
    assert q3.rowwise.scale.item() == 1 / 64  # window {7, 3.5} -> 448 / 7
    q4 = recipe.quantize_activation(torch.zeros(1, 2), state=state, columnwise=False)
    assert q4.rowwise.scale.item() == 1 / 64  # window {0, 7}
    recipe.quantize_activation(torch.zeros(1, 2), state=state, columnwise=False)
    # window {0, 0}: the scale is kept, not reset to 1
    assert state.input.scale.item() == 64.0
    with pytest.raises(ValueError, match="new_state"):
        recipe.quantize_activation(x1)
