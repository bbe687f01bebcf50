"""The guard that zeroes grads still flagged stale before a reduce (trainer/kernels/stale_zero.py): the
host path on CPU, the Triton kernel on CUDA, the same result."""

from __future__ import annotations

import pytest
import torch

from trainer.kernels import stale_zero
from trainer.kernels.stale_zero import StaleGuard


def _case(device: str) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    # three params, the middle one longer than a Triton chunk (two chunks and a tail), and padding around them
    grad = torch.arange(300_000, dtype=torch.float32, device=device) + 1.0
    flags = torch.tensor([1, 0, 1, 1], dtype=torch.int32, device=device)
    ranges = [(128, 1128, 0), (2048, 2048 + 150_001, 2), (200_000, 200_777, 1)]  # flags 1, 1, 0
    return grad, flags, ranges


def _want(grad: torch.Tensor) -> torch.Tensor:
    want = grad.clone()
    want[128:1128] = 0.0
    want[2048:2048 + 150_001] = 0.0
    return want


def test_host_path_zeroes_the_still_flagged_and_clears_only_their_flags() -> None:
    grad, flags, ranges = _case("cpu")
    want = _want(grad)
    StaleGuard(grad, flags, ranges).zero_unwritten_()
    assert torch.equal(grad, want)  # flag 1 (written this step) and every byte outside the ranges untouched
    assert flags.tolist() == [0, 0, 0, 1]  # flag 3 belongs to another group: left as it was


def test_nothing_flagged_changes_nothing() -> None:
    grad, flags, ranges = _case("cpu")
    flags.zero_()
    before = grad.clone()
    StaleGuard(grad, flags, ranges).zero_unwritten_()
    assert torch.equal(grad, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernel_equals_the_host_path_on_gpu() -> None:
    from trainer.kernels import has_triton

    if not has_triton():
        pytest.skip("needs Triton")
    grad, flags, ranges = _case("cuda")
    want = _want(grad)
    guard = StaleGuard(grad, flags, ranges)
    guard.zero_unwritten_()
    assert guard._chunks is not None  # the kernel ran, not the host path
    assert torch.equal(grad, want)
    assert flags.tolist() == [0, 0, 0, 1]
    grad.fill_(5.0)
    guard.zero_unwritten_()  # flags now clear: nothing stored
    assert torch.equal(grad, torch.full_like(grad, 5.0))


def test_module_names_its_kernel() -> None:
    assert "stale_zero_triton" in (stale_zero.__doc__ or "")
