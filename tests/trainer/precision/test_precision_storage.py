"""The QuantizedTensor storage type: bytes round trip, views into a buffer, grouped vs per-expert
quantization (bitwise), columnwise copy == quantize of the transpose (bitwise), for every recipe."""

from __future__ import annotations

import pytest
import torch

from trainer.precision import (
    BlockwiseRecipe,
    DelayedRecipe,
    MXFP8Recipe,
    NVFP4Recipe,
    QuantizedTensor,
    RowwiseRecipe,
    TensorwiseRecipe,
    quantize,
)
from trainer.precision.quantized_tensor import ALIGN

RECIPES = {
    "tensorwise": TensorwiseRecipe(),
    "rowwise": RowwiseRecipe(),
    "blockwise": BlockwiseRecipe(),
    "mxfp8": MXFP8Recipe(),
    "mxfp8-rceil": MXFP8Recipe(scale_rounding="rceil"),
    "nvfp4": NVFP4Recipe(None),
}


def _weight(E: int = 3) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(E, 64, 160, dtype=torch.bfloat16)
    w[1] *= 30  # experts of very different ranges: a shared scale would show
    return w


def _bytes_equal(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    return a.byte_layout() == b.byte_layout() and torch.equal(a.to_bytes(), b.to_bytes())


@pytest.mark.parametrize("name", RECIPES)
def test_grouped_quantize_equals_per_expert_bitwise(name: str) -> None:
    recipe = RECIPES[name]
    w = _weight()
    grouped = recipe.quantize_weight(w)
    per_expert = [recipe.quantize_weight(w[e]) for e in range(w.shape[0])]
    for e in range(w.shape[0]):
        assert _bytes_equal(grouped.expert(e), per_expert[e]), f"expert {e}"
    assert _bytes_equal(QuantizedTensor.stack(per_expert), grouped)


def test_delayed_grouped_equals_per_expert() -> None:
    recipe, w = DelayedRecipe(), _weight()
    grouped_state = recipe.new_state(w.shape[0])
    states = [recipe.new_state() for _ in range(w.shape[0])]
    for step in range(3):  # the histories stay in step as well
        w = w * 1.5
        grouped = recipe.quantize_weight(w, state=grouped_state)
        for e in range(w.shape[0]):
            assert _bytes_equal(grouped.expert(e), recipe.quantize_weight(w[e], state=states[e])), (step, e)


@pytest.mark.parametrize("name", RECIPES)
def test_columnwise_equals_quantize_of_transpose(name: str) -> None:
    recipe = RECIPES[name]
    w = _weight()
    q = recipe.quantize_weight(w)
    t = quantize(w.transpose(-2, -1), recipe.weight_scheme())
    assert torch.equal(q.columnwise.data.view(torch.uint8), t.rowwise.data.view(torch.uint8))
    assert torch.equal(q.columnwise.scale.view(torch.uint8), t.rowwise.scale.view(torch.uint8))
    # and for activations, whose columnwise copy is always re-quantized along tokens
    x = w[0]
    qa = recipe.quantize_activation(x)
    ta = quantize(x.t(), recipe.activation_scheme())
    assert torch.equal(qa.columnwise.data.view(torch.uint8), ta.rowwise.data.view(torch.uint8))


@pytest.mark.parametrize("name", RECIPES)
def test_bytes_round_trip(name: str) -> None:
    q = RECIPES[name].quantize_weight(_weight())
    layout = q.byte_layout()
    buf = q.to_bytes()
    assert buf.dtype == torch.uint8 and buf.numel() == layout.nbytes
    assert all(seg.offset % ALIGN == 0 for seg in layout.segments)
    assert sum(seg.nbytes for seg in layout.segments) == q.nbytes
    back = QuantizedTensor.from_bytes(buf, layout)
    assert torch.equal(back.to_bytes(), buf)
    assert torch.equal(back.dequantize(), q.dequantize())
    assert torch.equal(back.dequantize(copy="columnwise"), q.dequantize(copy="columnwise"))


def test_from_bytes_views_a_larger_buffer_in_place() -> None:
    # A param's bytes inside a bigger (e.g. all-gathered) buffer: the tensor is a view, no copy.
    recipe = TensorwiseRecipe()
    q = recipe.quantize_weight(_weight()[0], columnwise=False)
    layout = q.byte_layout()
    big = torch.zeros(64 + layout.nbytes + 32, dtype=torch.uint8)
    q.to_bytes(out=big[64 : 64 + layout.nbytes])
    view = QuantizedTensor.from_bytes(big[64:], layout)
    assert view.rowwise.data.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
    assert torch.equal(view.dequantize(), q.dequantize())
    # new values written through copy_ land in the buffer
    q2 = recipe.quantize_weight(_weight()[0] * 3, columnwise=False)
    view.copy_(q2)
    assert torch.equal(big[64 : 64 + layout.nbytes], q2.to_bytes())
    # the per-tensor FP8 param-gather path: gather rowwise bytes, then build the transpose locally
    assert torch.equal(view.with_columnwise().columnwise.data.view(torch.uint8), q2.with_columnwise().columnwise.data.view(torch.uint8))


def test_from_bytes_rejects_misaligned_and_short_buffers() -> None:
    q = TensorwiseRecipe().quantize_weight(torch.randn(16, 16))
    layout = q.byte_layout()
    big = torch.zeros(layout.nbytes + 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="aligned"):
        QuantizedTensor.from_bytes(big[1:], layout)
    with pytest.raises(ValueError, match="needs"):
        QuantizedTensor.from_bytes(big[: layout.nbytes - 1], layout)


def test_layout_segments_name_each_piece() -> None:
    q = NVFP4Recipe(None).quantize_weight(torch.randn(2, 32, 64))
    names = [s.name for s in q.byte_layout().segments]
    assert names == [
        "rowwise.data",
        "rowwise.scale",
        "rowwise.global_scale",
        "columnwise.data",
        "columnwise.scale",
        "columnwise.global_scale",
    ]
    seg = q.byte_layout().segment("rowwise.data")
    assert seg.shape == (2, 32, 32) and seg.nbytes == 2 * 32 * 32  # two e2m1 values per byte


def test_fp8_param_bytes_per_element() -> None:
    # what an FP8 param gather ships: 1 byte per element plus a few scale bytes (target <= 1.02)
    q = TensorwiseRecipe().quantize_weight(torch.randn(256, 512), columnwise=False)
    assert q.byte_layout().nbytes / (256 * 512) <= 1.02


def test_with_columnwise_refuses_one_d_blocks() -> None:
    q = MXFP8Recipe().quantize_weight(torch.randn(64, 64), columnwise=False)
    with pytest.raises(ValueError, match="re-quantize"):
        q.with_columnwise()
    with pytest.raises(ValueError, match="no columnwise copy"):
        q.dequantize_copy("columnwise")


def test_shard_cast_with_global_amax_gives_the_slice_bytes() -> None:
    # Per-tensor FP8 param gather: each rank casts only its flat shard of the master with the amax
    # all-reduced over ranks; the shards' bytes concatenate to exactly the whole tensor's rowwise data.
    torch.manual_seed(5)
    w = torch.randn(48, 64)
    scheme = TensorwiseRecipe().weight_scheme()
    whole = quantize(w, scheme)
    flat, amax = w.reshape(-1), w.abs().amax()
    shards = [quantize(flat[i : i + 1000].view(1, -1), scheme, amax=amax) for i in range(0, flat.numel(), 1000)]
    got = torch.cat([s.rowwise.data.view(torch.uint8).reshape(-1) for s in shards])
    assert torch.equal(got, whole.rowwise.data.view(torch.uint8).reshape(-1))
    assert all(s.rowwise.scale.item() == whole.rowwise.scale.item() for s in shards)
