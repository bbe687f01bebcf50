"""`ckpt.layout` as pure functions: the interleave math, stack/unbind with optimizer twins, and every
strictness error naming its tensor."""

from __future__ import annotations

import pytest
import torch

from ckpt.layout import (
    detect_layout,
    fc1_row_order,
    normalize_for_model,
    parse_expert_key,
    reinterleave_fc1,
    to_per_expert,
    to_single_grouped,
)
from moectl.core.errors import CheckpointError

P = "decoder.layers.0.mlp.experts.linear_fc1"


def test_megatron_interleave_example_and_round_trips() -> None:
    # Megatron's test_grouped_mlp: [1,2,5,6,3,4,7,8] with I=2 is 1..8 contiguous
    t = torch.tensor([1, 2, 5, 6, 3, 4, 7, 8])
    assert reinterleave_fc1(t, 2, None, 4).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    x = torch.arange(2 * 96)
    for a, b in ((None, 32), (32, 16), (16, 96), (96, None), (48, 32)):
        y = reinterleave_fc1(reinterleave_fc1(x, None, a, 96), a, b, 96)
        assert torch.equal(reinterleave_fc1(y, b, None, 96), x), (a, b)
    # interleaved row b*2I + h*I + o holds contiguous row h*F + b*I + o
    order = fc1_row_order(None, 32, 96)
    for b, h, o in ((0, 0, 0), (1, 1, 5), (2, 0, 31), (2, 1, 31)):
        assert order[b * 64 + h * 32 + o] == h * 96 + b * 32 + o
    assert reinterleave_fc1(x, 32, 32, 96) is x


def test_reinterleave_refuses_sizes_that_do_not_divide_or_odd_rows() -> None:
    with pytest.raises(CheckpointError, match="must be a positive int dividing the expert ffn size 96"):
        reinterleave_fc1(torch.zeros(192), None, 40, 96)
    with pytest.raises(CheckpointError, match="expected 2 \\* ffn size = 192"):
        reinterleave_fc1(torch.zeros(96, 4), None, 32, 96)


def test_stack_and_unbind_carry_optimizer_twins_and_leave_others() -> None:
    g = torch.Generator().manual_seed(0)
    suffixes = ("", ".main_param", ".exp_avg", ".exp_avg_sq", ".momentum_buffer")
    grouped = {f"{P}.weight{s}": torch.randn(3, 8, 4, generator=g) for s in suffixes}
    grouped["decoder.layers.0.mlp.router.weight"] = other = torch.randn(3, 4, generator=g)
    per = to_per_expert(grouped, 3)
    assert f"{P}.weight2.momentum_buffer" in per and per["decoder.layers.0.mlp.router.weight"] is other
    assert all(t.is_contiguous() for t in per.values())
    back = to_single_grouped(per, 3)
    assert list(back) == list(grouped) and all(torch.equal(back[n], grouped[n]) for n in grouped)


def test_normalize_reorders_weight_and_bias_rows_and_sets_each_layout() -> None:
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
    b = torch.arange(2 * 8, dtype=torch.float32).view(2, 8)
    out = normalize_for_model({f"{P}.weight": w, f"{P}.bias0": b[0], f"{P}.bias1": b[1]}, num_experts=2,
                              target_layout="single-grouped", target_bias_layout="per-expert",
                              source_interleave=2, target_interleave=None)  # fmt: skip
    assert sorted(out) == [f"{P}.bias0", f"{P}.bias1", f"{P}.weight"]
    order = fc1_row_order(2, None, 4)
    assert torch.equal(out[f"{P}.weight"], w[:, order]) and torch.equal(out[f"{P}.bias1"], b[1][order])


@pytest.mark.parametrize(
    "names, match",
    [
        ([f"{P}.weight0", f"{P}.weight1", f"{P}.weight3"], rf"missing {P}\.weight2"),
        ([f"{P}.weight{e}" for e in range(5)], rf"{P}\.weight4' is expert 4, but num_experts is 4"),
        ([f"{P}.weight", f"{P}.weight1"], rf"{P}\.weight' is present both grouped and as per-expert '{P}\.weight1'"),
        ([f"{P}.weight_fp8"], rf"{P}\.weight_fp8' is under \.experts\.linear_fc"),
        ([f"{P}.weight07"], rf"{P}\.weight07' is under"),
    ],
)
def test_strict_expert_sets(names: list[str], match: str) -> None:
    tensors = {n: torch.zeros(8, 2) for n in names}
    with pytest.raises(CheckpointError, match=match):
        to_single_grouped(tensors, 4)


def test_wrong_counts_shapes_and_mixed_layouts_are_named() -> None:
    with pytest.raises(CheckpointError, match=rf"{P}\.weight\.exp_avg' is float32\[3, 8, 2\], expected 3-D with 4 experts"):
        to_per_expert({f"{P}.weight.exp_avg": torch.zeros(3, 8, 2)}, 4)
    parts = {f"{P}.bias{e}": torch.zeros(8) for e in range(2)}
    parts[f"{P}.bias1"] = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match=rf"{P}\.bias1' is bfloat16\[8\], but '{P}\.bias0' is float32\[8\]"):
        to_single_grouped(parts, 2)
    mixed = [f"{P}.weight", "decoder.layers.1.mlp.experts.linear_fc2.weight0"]
    with pytest.raises(CheckpointError, match="expert weights mix layouts"):
        detect_layout(mixed)
    assert detect_layout(mixed, "bias") is None and detect_layout(["embedding.word_embeddings.weight"]) is None
    assert parse_expert_key("decoder.layers.0.mlp.linear_fc1.weight") is None  # dense MLP: not an expert
