"""A synchronous save's copy to the host (ckpt/host_copy.py): device tensors staged once in one buffer, host
tensors and memory-short cases passed through, a refused copy falling back rather than failing the rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckpt import host_copy


def _files() -> dict[str, dict[str, torch.Tensor]]:
    return {"model-00000.safetensors": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)}}


class _FakeStaging:
    """Records stage/release; stands in for the page-locked buffer a CUDA tensor would be copied into."""

    log: list[str] = []
    fail = False

    def stage(self, files: Any) -> Any:
        self.log.append("stage")
        if self.fail:
            raise RuntimeError("cudaHostRegister refused")
        return {f: {n: t.clone() for n, t in ts.items()} for f, ts in files.items()}

    def release(self) -> None:
        self.log.append("release")


@pytest.fixture
def on_device(monkeypatch: pytest.MonkeyPatch) -> type[_FakeStaging]:
    _FakeStaging.log, _FakeStaging.fail = [], False
    monkeypatch.setattr(host_copy, "_on_device", lambda files: True)
    monkeypatch.setattr(host_copy, "HostStaging", _FakeStaging)
    return _FakeStaging


def test_host_tensors_pass_through_untouched() -> None:
    files = _files()
    with host_copy.on_host(files) as got:
        assert got is files


def test_device_tensors_are_staged_once_and_the_buffer_freed_after_the_block(on_device: Any) -> None:
    files = _files()
    with host_copy.on_host(files) as got:
        assert got is not files and torch.equal(got["model-00000.safetensors"]["w"], files["model-00000.safetensors"]["w"])
        assert on_device.log == ["stage"]
    assert on_device.log == ["stage", "release"]


def test_short_memory_or_a_refused_copy_falls_back_to_the_per_file_copies(on_device: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    files = _files()
    monkeypatch.setattr(host_copy, "host_memory_available", lambda: 1 << 20)
    with host_copy.on_host(files) as got:
        assert got is files and on_device.log == []
    monkeypatch.setattr(host_copy, "host_memory_available", lambda: None)
    on_device.fail = True
    with host_copy.on_host(files) as got:  # never raises: a rank failing here would miss the save's vote
        assert got is files
    assert on_device.log == ["stage", "release"]
