"""Where `train.cuda_graph: null` captures, and the pinned quantized weights (CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moectl.core.config.load import load_config
from trainer.graphs import StaticWeights, wants_cuda_graph
from trainer.precision.recipes.tensorwise import TensorwiseRecipe

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
PAD = ["moe.capacity_factor=1.0", "moe.pad_expert_input_to_capacity=true"]


@pytest.mark.parametrize(
    ("sets", "device", "want"),
    [
        (PAD, CUDA, True),
        ([*PAD, "mixed_precision.bf16=true", "mixed_precision.fp8=e4m3"], CUDA, True),
        ([*PAD, "mixed_precision.bf16=true", "mixed_precision.fp8=e4m3", "mixed_precision.fp8_param_gather=true"],
         CUDA, True),
        (PAD, CPU, False),
        ([], CUDA, True),  # dropless bf16: T*K rows, split by device offsets
        (["moe.single_grouped_weight=false"], CUDA, True),
        (["mixed_precision.bf16=true", "mixed_precision.fp8=e4m3"], CUDA, False),  # dropless fp8: aligned rows
        (["moe.capacity_factor=1.0"], CUDA, False),  # drops but does not pad
        ([*PAD, "parallel.expert_model_parallel_size=2"], CUDA, False),
        ([*PAD, "moe.backend=loop"], CUDA, False),
        ([*PAD, "optimizer.optimizer=muon"], CUDA, True),  # measured: 1.12x (dropless) and bitwise
        ([*PAD, "optimizer.optimizer=sgd"], CUDA, False),  # MOE060
        ([*PAD, "mixed_precision.bf16=true", "mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=mxfp8"],
         CUDA, False),
        ([*PAD, "train.cuda_graph=false"], CUDA, False),
        (["train.cuda_graph=true"], CUDA, True),  # explicit: the rules refuse what cannot work, not this
    ],
)
def test_null_captures_only_where_measured(sets: list[str], device: torch.device, want: bool) -> None:
    assert wants_cuda_graph(load_config(None, sets), device) is want


class _Site(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quantized_weight = None


def test_pinned_weights_keep_their_addresses_and_follow_each_publication() -> None:
    """A publication installs a new rowwise-only object (as fp8 param gather does); refresh copies it, with a
    columnwise copy rebuilt from its bytes, into the same pinned tensors, and installs the pinned object."""
    recipe = TensorwiseRecipe("e4m3", emulate="always")
    site = _Site()
    model = nn.Sequential(site)
    weights = StaticWeights(model)
    assert weights.refresh() == 0  # nothing published yet
    first = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    site.quantized_weight = recipe.quantize_weight(first, columnwise=False)
    assert weights.refresh() == 1
    pinned = site.quantized_weight
    ptrs = [t.data_ptr() for q in (pinned.rowwise, pinned.columnwise) for t in q.tensors().values()]
    expect = recipe.quantize_weight(first, columnwise=True)
    assert torch.equal(pinned.columnwise.data.view(torch.uint8), expect.columnwise.data.view(torch.uint8))

    second = first * 3 + 1
    site.quantized_weight = recipe.quantize_weight(second, columnwise=False)
    weights.refresh()
    assert site.quantized_weight is pinned
    assert [t.data_ptr() for q in (pinned.rowwise, pinned.columnwise) for t in q.tensors().values()] == ptrs
    expect = recipe.quantize_weight(second, columnwise=True)
    for which in ("rowwise", "columnwise"):
        got, want = getattr(pinned, which), getattr(expect, which)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), which
        assert torch.equal(got.scale, want.scale), which

    # a publication written in place into the pinned rowwise bytes (the per-expert path) still gets a fresh
    # columnwise copy: refresh never trusts a cached one
    pinned.rowwise.data.copy_(recipe.quantize_weight(first, columnwise=False).rowwise.data)
    pinned.rowwise.scale.copy_(recipe.quantize_weight(first, columnwise=False).rowwise.scale)
    weights.refresh()
    expect = recipe.quantize_weight(first, columnwise=True)
    assert torch.equal(pinned.columnwise.data.view(torch.uint8), expect.columnwise.data.view(torch.uint8))
