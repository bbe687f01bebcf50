"""Which device a process trains on (trainer/runtime.py: pick_device)."""

from __future__ import annotations

import pytest
import torch

from moectl.core.errors import UsageError
from trainer.runtime import pick_device


def test_more_local_ranks_than_gpus_is_one_usage_error_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU-device trial: `--nproc-per-node 2` on a one-GPU host died in rank 1 with CUDA's "invalid device
    ordinal" and a traceback. Now one line naming the rank, the GPUs this host shows and the two fixes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail(f"set_device({i}) was called"))
    for choice in ("auto", "cuda"):
        with pytest.raises(UsageError) as e:
            pick_device(choice, 1)
        assert e.value.exit_code == 2
        assert e.value.one_line() == (
            f"train.device='{choice}': local rank 1 needs GPU 1, but this host shows 1 GPU. fix: launch at most "
            "1 process per node (--nproc-per-node 1), or set train.device=cpu")


def test_a_rank_with_its_gpu_gets_it_and_cpu_never_asks_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert pick_device("auto", 1) == torch.device("cuda", 1) and chosen == [1]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("asked for a CPU run"))
    assert pick_device("cpu", 3) == torch.device("cpu")


class _Joined(Exception):
    """Raised by the stand-in for init_process_group: the backend was chosen, stop there."""


@pytest.mark.parametrize("device, backend", [(torch.device("cpu"), "gloo"), (torch.device("cuda", 1), "nccl")])
def test_the_process_group_backend_follows_the_device_picked(monkeypatch: pytest.MonkeyPatch, device: torch.device,
                                                             backend: str) -> None:  # fmt: skip
    """A device-tool trial: `train.device=cpu --nproc-per-node 2` on a GPU host joined NCCL (chosen because CUDA
    was available) and died at the first broadcast ("No backend type associated with device type cpu")."""
    import torch.distributed as dist

    from moectl.core.config.schema import ParallelConfig
    from trainer.parallel.groups import init_distributed

    chosen: list[str] = []
    set_to: list[torch.device] = []

    def join(backend: str, **_: object) -> None:
        chosen.append(backend)
        raise _Joined

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", join)
    with pytest.raises(_Joined):
        init_distributed(ParallelConfig(), device=device)
    assert chosen == [backend]
    assert set_to == ([device] if backend == "nccl" else [])
