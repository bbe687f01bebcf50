"""Shard files written and hashed at disk speed (ckpt/st_layout.py, ckpt/shard_io.py): the same bytes as
safetensors, the same hashes as hashlib, whatever the chunking and the thread count."""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from pathlib import Path

import pytest
import torch
from ckpt_fixtures import mixed_tensors
from safetensors.torch import save as st_save

from ckpt import shard_io
from ckpt.shards import prepare, write_shard
from ckpt.st_header import TORCH_NAME
from ckpt.st_layout import layout

DTYPES = [getattr(torch, name) for name in TORCH_NAME.values()]
NAMES = ["a", "b", "é", "x.y", '"q', "\\", "\n", "tab\t", "ü\x01", "zz"]


def _random_tensors(rng: random.Random) -> dict[str, torch.Tensor]:
    out = {}
    for _ in range(rng.randint(0, 10)):
        dtype = rng.choice(DTYPES)
        shape = [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
        raw = torch.randint(0, 256, shape + [dtype.itemsize], dtype=torch.uint8)
        out[rng.choice(NAMES) + str(rng.randint(0, 30))] = raw.view(dtype).reshape(shape)
    return out


def test_the_layout_is_byte_for_byte_what_safetensors_writes() -> None:
    rng = random.Random(0)
    for _ in range(150):  # every dtype a checkpoint records, odd names, empty and 0-d tensors, with/without metadata
        tensors = _random_tensors(rng)
        metadata = rng.choice([None, {"format": "pt"}, {"k": "vé"}])
        want = st_save(tensors, metadata=metadata)
        lay = layout(tensors, metadata)
        got = bytearray(lay.header)
        for p in lay.placed:
            assert len(got) == p.start
            got += shard_io.byte_view(p.tensor).tobytes()
        assert bytes(got) == want and lay.size == len(want)


@pytest.mark.parametrize("threads", [1, 3])
def test_written_files_and_hashes_match_for_any_chunking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          threads: int) -> None:  # fmt: skip
    # Chunks of 64 bytes: tensors split across many pwritev calls and calls spanning several tensors.
    monkeypatch.setattr(shard_io, "CHUNK", 64)
    monkeypatch.setattr(shard_io, "READ_CHUNK", 64)
    tensors = prepare(mixed_tensors(3), "model-00000.safetensors")
    rec, trecs = write_shard(tmp_path / "model-00000.safetensors", tensors, threads=threads)
    data = (tmp_path / "model-00000.safetensors").read_bytes()
    assert data == st_save(tensors, metadata={"format": "pt"})
    assert rec == {"sha256": _tree_of(data), "size": len(data)}
    for name, t in tensors.items():
        assert trecs[name]["sha256"] == hashlib.sha256(shard_io.byte_view(t)).hexdigest(), name
    # Reading back with overlapped reads, whole and by range, in chunks smaller than a tensor.
    path = tmp_path / "model-00000.safetensors"
    assert shard_io.hash_file(path) == hashlib.sha256(data).hexdigest()
    assert shard_io.hash_file(path, 13, 500) == hashlib.sha256(data[13:500]).hexdigest()
    # Ranges grouped into reads of at most READ_CHUNK bytes, a larger one alone; empty ranges too.
    ranges = [(0, 8), (8, 8), (8, 40), (40, 100), (100, 400), (400, 401), (401, len(data))]
    groups = shard_io.range_jobs(ranges)
    assert [r for g in groups for r in g] == ranges
    assert all(len(g) == 1 or g[-1][1] - g[0][0] <= 64 for g in groups)
    assert [h for g in groups for h in shard_io.hash_ranges(path, g)] == [
        hashlib.sha256(data[a:b]).hexdigest() for a, b in ranges]


def _tree_of(data: bytes) -> str:
    """The format 3 file digest (ckpt/digest.py), computed from the file's bytes with hashlib alone."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    h = hashlib.sha256(hashlib.sha256(data[: 8 + n]).digest())
    for b, e in spans:
        h.update(hashlib.sha256(data[8 + n + b : 8 + n + e]).digest())
    return h.hexdigest()


def test_a_failing_write_raises_after_every_thread_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_io, "CHUNK", 256)
    calls = []

    def full_disk(fd: int, bufs: list, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return sum(len(b) for b in bufs)

    monkeypatch.setattr(os, "pwritev", full_disk)
    big = {"w": torch.arange(1000, dtype=torch.float32)}
    with pytest.raises(OSError, match="No space left"):
        write_shard(tmp_path / "optim-00000.safetensors", prepare(big, "optim-00000.safetensors"), threads=4)
    seen = len(calls)
    time.sleep(0.05)
    assert len(calls) == seen < 16  # nothing writes after the error was raised; the rest were cancelled
    with pytest.raises(FileExistsError):  # never overwrites: a second save of the same file name is a bug
        write_shard(tmp_path / "optim-00000.safetensors", prepare(big, "optim-00000.safetensors"))


def test_short_writes_are_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev

    def at_most_7_bytes(fd: int, bufs: list, offset: int) -> int:
        return real(fd, [bytes(b)[:7] for b in bufs[:1]], offset)

    monkeypatch.setattr(os, "pwritev", at_most_7_bytes)
    tensors = {"a": torch.arange(10, dtype=torch.int16), "b": torch.ones(3)}
    write_shard(tmp_path / "model-00000.safetensors", tensors, threads=1)
    assert (tmp_path / "model-00000.safetensors").read_bytes() == st_save(tensors, metadata={"format": "pt"})


def test_a_dtype_or_layout_the_format_cannot_hold_is_named_before_any_write() -> None:
    with pytest.raises(ValueError, match=r"model-00000.safetensors: 'c': dtype torch.complex128 cannot be saved"):
        prepare({"c": torch.zeros(2, dtype=torch.complex128)}, "model-00000.safetensors")
    with pytest.raises(ValueError, match="'s' is a torch.sparse_coo tensor"):
        prepare({"s": torch.ones(2).to_sparse()}, "model-00000.safetensors")


def test_one_writer_writes_the_file_front_to_back_and_starts_its_writeback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # Buffered writes to one file are serialised by the filesystem: one writer, in file order, and every
    # chunk handed to writeback as soon as it is written; the bytes are still exactly safetensors'.
    from ckpt import writeback

    monkeypatch.setattr(shard_io, "CHUNK", 256)
    writes: list[tuple[int, int]] = []
    real_pwritev = os.pwritev

    def pwritev(fd: int, bufs: list, offset: int) -> int:
        n = real_pwritev(fd, bufs, offset)
        writes.append((offset, n))
        return n

    kicked: list[tuple[int, int]] = []
    monkeypatch.setattr(shard_io.os, "pwritev", pwritev)
    monkeypatch.setattr(writeback.Writeback, "kick", lambda self, o, n: kicked.append((o, n)))
    tensors = prepare(mixed_tensors(5), "model-00000.safetensors")
    write_shard(tmp_path / "model-00000.safetensors", tensors, threads=4)
    assert (tmp_path / "model-00000.safetensors").read_bytes() == st_save(tensors, metadata={"format": "pt"})
    assert len(writes) > 3 and [o for o, _ in writes] == sorted(o for o, _ in writes)
    assert all(a + n == b for (a, n), (b, _) in zip(writes, writes[1:]))  # contiguous, no gaps, no reorder
    assert kicked == writes


def test_writeback_is_asked_where_it_works_and_dropped_where_refused(tmp_path: Path) -> None:
    from ckpt.writeback import Writeback

    with open(tmp_path / "f", "wb", buffering=0) as f:
        f.write(b"x" * 10_000)
        wb = Writeback(f.fileno())
        wb.kick(0, 10_000)  # a regular file on Linux: accepted (elsewhere a no-op)
        assert wb.enabled == (os.uname().sysname == "Linux")
    r, w = os.pipe()
    try:
        wb = Writeback(w)
        wb.kick(0, 1)  # a pipe: the kernel refuses (ESPIPE); never asked again
        assert not wb.enabled
    finally:
        os.close(r)
        os.close(w)


def test_a_write_failing_mid_file_fails_the_save_and_leaves_latest_on_the_previous_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    import errno

    from ckpt import save_checkpoint
    from ckpt.save import CheckpointSaveError
    from ckpt_fixtures import make_meta

    files = {"model-00000.safetensors": mixed_tensors(1)}
    save_checkpoint(tmp_path, 1, files, make_meta())
    monkeypatch.setattr(shard_io, "CHUNK", 128)
    calls = {"n": 0}
    real = shard_io._pwritev_all

    def failing(fd: int, offset: int, bufs: list) -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # the disk fills up part-way through the file
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, bufs)

    monkeypatch.setattr(shard_io, "_pwritev_all", failing)
    with pytest.raises(CheckpointSaveError, match="No space left on device"):
        save_checkpoint(tmp_path, 2, {"model-00000.safetensors": mixed_tensors(2)}, make_meta())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]  # nothing of step 2
    assert (tmp_path / "latest").read_text() == "step_00000001\n"


@pytest.mark.parametrize("value", ["abc", "0", "-3", "2.5"])
def test_a_bad_ckpt_threads_variable_is_the_users_error_naming_it(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """It was a ValueError: a traceback, or a failed save after the steps before it had trained."""
    from moectl.core.errors import UsageError

    monkeypatch.setenv(shard_io.ENV_THREADS, value)
    with pytest.raises(UsageError, match=f"MOECTL_CKPT_THREADS='{value}' is not a positive integer") as e:
        shard_io.io_threads()
    assert e.value.exit_code == 2 and "unset it" in (e.value.fix or "")
    monkeypatch.setenv(shard_io.ENV_THREADS, " 3 ")
    assert shard_io.io_threads() == 3
