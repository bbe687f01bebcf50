"""Where `train.cuda_graph: null` captures, and the pinned quantized weights (CPU)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

from moectl.core.config.load import load_config
from trainer.distributed.bucket_group import GradSyncError
from trainer.graphs import MicroBatchGraph, StaticWeights, wants_cuda_graph
from trainer.graphs.capture import GraphCaptureError
from trainer.precision.recipes.tensorwise import TensorwiseRecipe

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
PAD = ["moe.capacity_factor=1.0", "moe.pad_expert_input_to_capacity=true"]


BF16 = ["mixed_precision.bf16=true"]
FP8 = [*BF16, "mixed_precision.fp8=e4m3"]
HOPPER = (9, 0)


@pytest.mark.parametrize(
    ("sets", "device", "capability", "want"),
    [
        ([*BF16, *PAD], CUDA, HOPPER, True),
        ([*FP8, *PAD], CUDA, HOPPER, True),
        ([*FP8, *PAD, "mixed_precision.fp8_param_gather=true"], CUDA, HOPPER, True),
        ([*BF16, *PAD], CPU, None, False),
        (BF16, CUDA, HOPPER, True),  # dropless bf16: T*K rows, split by device offsets
        ([*BF16, "moe.single_grouped_weight=false"], CUDA, HOPPER, True),
        ([*BF16, *PAD, "moe.add_bias=true"], CUDA, HOPPER, True),  # bias grads summed on the device
        (BF16, CUDA, (10, 0), True),  # Blackwell: grouped_mm's device-offset kernels too
        (BF16, CUDA, (8, 0), False),  # Ampere: grouped_mm's fallback reads the offsets on the host
        ([], CUDA, HOPPER, False),  # fp32 params: the same fallback
        (PAD, CUDA, HOPPER, False),
        (FP8, CUDA, HOPPER, True),  # dropless fp8 e4m3: rows bounded statically, split by device offsets
        # e5m2 grads: Triton backward (whole 128-wide tiles), device offsets
        ([*BF16, "mixed_precision.fp8=hybrid", "model.hidden_size=128", "moe.ffn_hidden_size=128"], CUDA, HOPPER, True),
        ([*BF16, "mixed_precision.fp8=hybrid"], CUDA, HOPPER, False),  # the default's dims 64: not whole tiles
        ([*BF16, "mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=rowwise"], CUDA, HOPPER, False),
        # expert dims the Triton kernels do not tile (ffn 1040 = 8 x 130): hybrid's backward would run emulated,
        # reading the split on the host
        ([*BF16, "mixed_precision.fp8=hybrid", "moe.ffn_hidden_size=1040"], CUDA, HOPPER, False),
        ([*BF16, "mixed_precision.fp8=e4m3", "moe.ffn_hidden_size=1040"], CUDA, HOPPER, True),  # torch's: % 16
        ([*BF16, "moe.capacity_factor=1.0"], CUDA, HOPPER, False),  # drops but does not pad
        # ep's all-to-all under drop-and-pad is static: 374 -> 258 ms captured on 4 H100s (benchmarks.md)
        ([*BF16, *PAD, "parallel.expert_model_parallel_size=2"], CUDA, HOPPER, True),
        (["parallel.expert_model_parallel_size=2", *BF16], CUDA, HOPPER, False),  # dropless: splits on the host
        ([*BF16, "parallel.expert_model_parallel_size=2", "moe.token_dispatcher=allgather"], CUDA, HOPPER, False),
        ([*BF16, *PAD, "moe.backend=loop"], CUDA, HOPPER, False),
        ([*BF16, *PAD, "moe.backend=te"], CUDA, HOPPER, False),  # TE's m_splits are host ints (MOE059)
        ([*BF16, *PAD, "optimizer.optimizer=muon"], CUDA, HOPPER, True),  # measured: 1.12x (dropless) and bitwise
        ([*BF16, *PAD, "optimizer.optimizer=sgd"], CUDA, HOPPER, False),  # MOE060
        ([*FP8, *PAD, "mixed_precision.fp8_recipe=mxfp8"], CUDA, HOPPER, False),  # replays bitwise; not timed
        ([*BF16, *PAD, "train.cuda_graph=false"], CUDA, HOPPER, False),
        (["train.cuda_graph=true"], CUDA, HOPPER, True),  # explicit: the rules refuse what cannot work, not this
    ],
)
def test_null_captures_only_where_measured(
    sets: list[str], device: torch.device, capability: tuple[int, int] | None, want: bool
) -> None:
    assert wants_cuda_graph(load_config(None, sets), device, capability) is want


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


class _FakeGraph:
    """What `_capture` asks of `torch.cuda.CUDAGraph`, on the CPU (nothing is recorded)."""

    def pool(self) -> None:
        return None

    def replay(self) -> None:
        pass


def _capture_raising(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())

    def loss(tokens: torch.Tensor, targets: torch.Tensor) -> Any:
        raise error

    MicroBatchGraph(torch.nn.Linear(2, 2), loss, n_micro=1).run(torch.zeros(1, 2), torch.zeros(1, 2))


def test_a_capture_failure_names_the_culprit_and_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(GraphCaptureError, match="could not be captured") as e:
        _capture_raising(monkeypatch, RuntimeError("operation not permitted when stream is capturing"))
    assert "train.cuda_graph=false" in e.value.one_line()


def test_the_steps_own_bookkeeping_errors_are_not_blamed_on_the_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """A param without a grad under overlapped reduce raises GradSyncError inside the capture of the last
    micro-batch: its own message says what to do, so it passes through rather than as "set cuda_graph=false"."""
    with pytest.raises(GradSyncError, match="every trainable param"):
        _capture_raising(monkeypatch, GradSyncError("with overlap_grad_reduce every trainable param must get a grad"))
