"""TokenGroups (trainer/precision/groups.py): row -> group ids, the int32 offsets for grouped_mm, validation."""

from __future__ import annotations

import pytest
import torch

from trainer.precision.groups import TokenGroups
from trainer.precision.qdata import QuantizedData


@pytest.mark.parametrize(
    "counts", [[3, 0, 5, 1], [0, 0, 4], [4, 0, 0], [0], [7], [2, 2, 0, 0, 9, 1, 0]], ids=str
)
def test_ids_are_each_rows_group(counts: list[int]) -> None:
    offs = torch.tensor(counts).cumsum(0)
    groups = TokenGroups.from_offsets(offs, sum(counts))
    want = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    assert groups.ids.dtype == torch.int64 and torch.equal(groups.ids, want)
    assert groups.count == len(counts) and groups.total == sum(counts)


def test_int32_offsets_are_made_once_and_reuse_given_int32() -> None:
    given32 = torch.tensor([2, 2, 6], dtype=torch.int32)
    g = TokenGroups.from_offsets(given32, 6)
    assert g.offsets.dtype == torch.int64 and g.offsets_i32 is given32
    g64 = TokenGroups.from_offsets(torch.tensor([1, 4]), 4)
    first = g64.offsets_i32
    assert first.dtype == torch.int32 and torch.equal(first, torch.tensor([1, 4], dtype=torch.int32))
    assert g64.offsets_i32 is first


@pytest.mark.parametrize("offs, total", [([3, 2, 5], 5), ([2, 4], 5), ([], 0)])
def test_bad_offsets_are_refused(offs: list[int], total: int) -> None:
    with pytest.raises(ValueError):
        TokenGroups.from_offsets(torch.tensor(offs, dtype=torch.int64), total)


def test_gemm_scale_is_derived_not_stored() -> None:
    q = QuantizedData(torch.zeros(4, 2), torch.ones(2), gemm_scale=torch.ones(4))
    assert list(q.tensors()) == ["data", "scale"]
    assert q.nbytes == 4 * 2 * 4 + 2 * 4
    assert q.map(lambda t: t.clone()).gemm_scale is None


def test_uniform_groups_answer_on_the_host_without_reading_offsets() -> None:
    """Drop-and-pad experts: every group's rows known on the host. The offsets live on the meta device here,
    so any read of them (what a CUDA graph capture forbids) would raise."""
    from trainer.precision.gemm import _segments
    from trainer.precision.quantized_tensor import QuantizedTensor

    offs = torch.empty(3, dtype=torch.int64, device="meta")
    groups = TokenGroups(offs, torch.empty(96, dtype=torch.int64, device="meta"), uniform=32)
    assert groups.sizes() == [32, 32, 32]
    groups.check_aligned(32, "mxfp8")  # 32 % 32: fine, decided on the host
    with pytest.raises(ValueError, match="multiple of 64"):
        groups.check_aligned(64, "a 64-row block")
    q = QuantizedTensor.__new__(QuantizedTensor)
    object.__setattr__(q, "groups", groups)
    assert _segments(q) == [(0, 32), (32, 64), (64, 96)]


def test_uniform_is_checked_against_the_rows_and_the_offsets() -> None:
    with pytest.raises(ValueError, match="do not make"):
        TokenGroups.from_offsets(torch.tensor([4, 8]), 8, uniform=3)
    with pytest.raises(ValueError, match="4 rows each"):
        TokenGroups.from_offsets(torch.tensor([3, 8]), 8, uniform=4)  # validate reads them (CPU)
    g = TokenGroups.from_offsets(torch.tensor([4, 8]), 8, uniform=4)
    assert g.uniform == 4 and g.sizes() == [4, 4]
