"""`to_host_later`: the values of a device tensor, read after the host queued more work."""

from __future__ import annotations

import pytest
import torch

from trainer.host_copy import to_host_later


def test_values_are_the_tensor_as_it_was_when_the_copy_started() -> None:
    t = torch.tensor([3, -1, 7], dtype=torch.int64)
    values = to_host_later(t)
    t.add_(1)  # after the call: as the CUDA copy, the values must not see it
    assert values() == [3, -1, 7]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device tool)")
def test_cuda_copy_is_not_overwritten_by_work_queued_after_it() -> None:
    t = torch.arange(4, device="cuda", dtype=torch.float64)
    values = to_host_later(t)
    t.mul_(10)  # queued after the copy: the copy must not see it
    assert values() == [0.0, 1.0, 2.0, 3.0]
