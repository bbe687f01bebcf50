"""Host staging (ckpt/staging.py, ckpt/host_arena.py): every tensor an aligned view of one exactly-sized
buffer, equal to its source bit for bit whatever its dtype or shape; reused while it fits, grown when not."""

from __future__ import annotations

import torch
from ckpt_fixtures import bits, mixed_tensors

from ckpt import host_arena
from ckpt.host_arena import ALIGN, HostArena
from ckpt.staging import HostStaging, staged_size


def _files(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    return {"model-00000.safetensors": mixed_tensors(seed),
            "optim-00000.safetensors": {"w.exp_avg": torch.full((33, 7), float(seed))}}  # fmt: skip


def test_staged_tensors_are_disjoint_aligned_views_equal_to_their_sources() -> None:
    staging, files = HostStaging(), _files(1)
    out = staging.stage(files)
    base = staging._arena.buffer.data_ptr()  # type: ignore[union-attr]
    assert staging.nbytes == staged_size(files) and staging.how == host_arena.PAGEABLE
    spans = []
    for fname, tensors in files.items():
        for name, src in tensors.items():
            got = out[fname][name]
            assert got.dtype == src.dtype and got.shape == src.shape and got.is_contiguous(), name
            assert torch.equal(bits(got), bits(src)), name
            if got.numel():
                assert (got.data_ptr() - base) % ALIGN == 0, name
                spans.append((got.data_ptr(), got.data_ptr() + got.numel() * got.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two views share a byte


def test_the_buffer_is_reused_while_it_fits_and_grown_when_not() -> None:
    staging = HostStaging()
    staging.stage(_files(1))
    ptr = staging._arena.buffer.data_ptr()  # type: ignore[union-attr]
    assert staging.new_bytes(_files(2)) == 0
    out = staging.stage(_files(2))
    assert staging._arena.buffer.data_ptr() == ptr  # type: ignore[union-attr]
    assert torch.equal(out["optim-00000.safetensors"]["w.exp_avg"], torch.full((33, 7), 2.0))
    bigger = {**_files(3), "optim-00001.safetensors": {"x": torch.ones(1000)}}
    assert staging.new_bytes(bigger) == staged_size(bigger)
    staging.stage(bigger)
    assert staging.nbytes == staged_size(bigger)
    staging.release()
    assert staging.nbytes == 0


def test_touching_pages_on_threads_zeroes_every_byte(monkeypatch) -> None:
    monkeypatch.setattr(host_arena, "_TOUCH_GRAIN", 1000)
    buf = torch.full((10_500,), 7, dtype=torch.uint8)
    host_arena.touch(buf, threads=3)
    assert int(buf.count_nonzero()) == 0


class _FakeCudart:
    """What `HostArena` asks of `torch.cuda.cudart()`, recorded (this machine may have no CUDA)."""

    def __init__(self, err: int) -> None:
        self.err, self.calls = err, []

    def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:
        self.calls.append(("register", ptr, n, flags))
        return self.err

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


def test_a_pinned_arena_is_one_mapping_touched_then_registered_and_unregistered(monkeypatch) -> None:
    fake = _FakeCudart(0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    arena = HostArena(3 << 20, pin=True, threads=2)
    ptr = arena.buffer.data_ptr()
    assert arena.how == host_arena.REGISTERED and arena.buffer.numel() == 3 << 20
    assert fake.calls == [("register", ptr, 3 << 20, 0)] and int(arena.buffer.count_nonzero()) == 0
    view = arena.view(128, torch.Size([4, 2]), torch.float64)
    assert view.data_ptr() == ptr + 128 and view.shape == (4, 2)
    arena.release()
    assert fake.calls[-1] == ("unregister", ptr) and arena.buffer.numel() == 0


def test_a_refused_registration_falls_back_to_torch_pinned_memory(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart(1))
    pinned = []

    def empty(*args, **kwargs):  # torch's pinned allocator needs a device: record the request instead
        pinned.append(kwargs.get("pin_memory", False))
        kwargs.pop("pin_memory", None)
        return real_empty(*args, **kwargs)

    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", empty)
    arena = HostArena(1 << 20, pin=True, threads=1)
    assert arena.how == host_arena.TORCH_PINNED and pinned[-1] is True and arena.buffer.numel() == 1 << 20
