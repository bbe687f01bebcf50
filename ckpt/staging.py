"""Host buffers a background save writes from: this rank's shards copied off the live state, reused.

A save in the background must not read tensors that training goes on changing (params and masters are
updated in place by the next step), so before training resumes each tensor this rank writes is copied
into host memory. On CUDA that memory is page-locked: the device-to-host copies run at the bus's speed and
are queued without a host round-trip per tensor, then one synchronisation waits for all of them. On a CPU
it is ordinary memory (plain copies: there is no device to copy from).

All of a rank's tensors live in one `ckpt.host_arena.HostArena`, each an aligned view at its own offset:
one allocation of the exact total, page-locked once (pinning gigabytes takes seconds: the OS must fault in
and lock every page; torch's per-tensor pinned buffers also rounded each up to a power of two, nearly
doubling what was pinned). It is allocated before the first save (`reserve_for`, which a training run
calls at start-up: `trainer.checkpointing.saver.RunCheckpointer.reserve`), else by the first save, and
reused by every later one, reallocated only when a save needs more bytes than it holds. Reuse is safe
because at most one save is in flight (`ckpt.async_save`): the next `stage` waits until the writer that
reads these buffers has finished.
"""

from __future__ import annotations

import torch

from ckpt.host_arena import HostArena, aligned, touch
from ckpt.shard_io import io_threads

Files = dict[str, dict[str, torch.Tensor]]


def staged_size(files: Files) -> int:
    """Bytes the arena needs for `files`: every tensor's bytes, each rounded up to the views' alignment."""
    return sum(aligned(t.numel() * t.element_size()) for tensors in files.values() for t in tensors.values())


class HostStaging:
    """Reusable host copies of a rank's shards (page-locked where the tensors live on a CUDA device)."""

    def __init__(self) -> None:
        self._arena: HostArena | None = None

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        return self._arena.nbytes if self._arena is not None else 0

    @property
    def how(self) -> str:
        """What the buffers are (`ckpt.host_arena`: registered, torch-pinned or pageable; '' before the first)."""
        return self._arena.how if self._arena is not None else ""

    def new_bytes(self, files: Files) -> int:
        """Host memory `stage(files)` would allocate (0 when the buffers it holds suffice)."""
        need = staged_size(files)
        return 0 if self._fits(need, _on_device(files)) else need

    def _fits(self, need: int, pin: bool) -> bool:
        return self._arena is not None and self._arena.nbytes >= need and self._arena.pin == pin

    def reserve(self, nbytes: int, pin: bool) -> None:
        """Allocate the buffers for saves of up to `nbytes` now, ahead of the first `stage` (a no-op when the
        buffers held suffice)."""
        if not self._fits(nbytes, pin):
            self.release()
            self._arena = HostArena(nbytes, pin, threads=io_threads())

    def reserve_for(self, files: Files) -> None:
        """Allocate now the buffers `stage(files)` will use, sized by the same rule (`staged_size`), and fault in
        their pages, so that a later `stage` of tensors of these shapes and dtypes only copies. Page-locked
        buffers are faulted in and locked as they are made; plain ones are touched here."""
        pin = _on_device(files)
        held = self._arena
        self.reserve(staged_size(files), pin)
        if self._arena is not held and self._arena is not None and not pin:
            touch(self._arena.buffer, io_threads())

    def stage(self, files: Files) -> Files:
        """Copy every tensor of `files` into the host buffers and return the copies, in the same structure.

        Returns once every copy has landed: the caller may then change the source tensors.
        """
        pin = _on_device(files)
        self.reserve(staged_size(files), pin)
        assert self._arena is not None
        out: Files = {}
        offset = 0
        for fname, tensors in files.items():
            out[fname] = {}
            for name, src in tensors.items():
                src = src.detach()
                buf = self._arena.view(offset, src.shape, src.dtype)
                offset += aligned(buf.numel() * buf.element_size())
                # non_blocking: from a CUDA tensor into page-locked memory the copy is queued on the current
                # stream, so the device keeps running while the host queues the rest; a CPU copy is immediate.
                buf.copy_(src, non_blocking=pin)
                out[fname][name] = buf
        if pin:
            torch.cuda.current_stream().synchronize()  # every queued copy has landed
        return out

    def release(self) -> None:
        """Free the buffers (the run is over, or they are being replaced)."""
        if self._arena is not None:
            self._arena.release()
            self._arena = None


def _on_device(files: Files) -> bool:
    return any(t.device.type == "cuda" for tensors in files.values() for t in tensors.values())


def host_memory_available() -> int | None:
    """Bytes of memory the OS can still hand out without swapping (`MemAvailable`), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
