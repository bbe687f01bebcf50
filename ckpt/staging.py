"""Host buffers a background save writes from: this rank's shards copied off the live state, reused.

A save in the background must not read tensors that training goes on changing (params and masters are
updated in place by the next step), so before training resumes each tensor this rank writes is copied
into a host buffer. On CUDA the buffers are pinned (page-locked): the device-to-host copies run at the
bus's speed and are queued without a host round-trip per tensor, then one synchronisation waits for all
of them. On a CPU they are ordinary tensors (plain copies: there is no device to copy from).

The buffers are allocated by the first save and reused by every later one (pinning gigabytes takes
seconds: the OS must lock every page), keyed by file and tensor name, and reallocated only when a shape or
dtype changes. Reuse is safe because at most one save is in flight (`ckpt.async_save`): the next
`stage` waits until the writer that reads these buffers has finished.
"""

from __future__ import annotations

import torch

Files = dict[str, dict[str, torch.Tensor]]


class HostStaging:
    """Reusable host copies of a rank's shards (pinned where the tensors live on a CUDA device)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def new_bytes(self, files: Files) -> int:
        """Host memory `stage(files)` would allocate (tensors without a reusable buffer)."""
        total = 0
        for fname, tensors in files.items():
            for name, src in tensors.items():
                buf = self._buffers.get((fname, name))
                if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                    total += src.numel() * src.element_size()
        return total

    def stage(self, files: Files) -> Files:
        """Copy every tensor of `files` into its host buffer and return the buffers, in the same structure.

        Returns once every copy has landed: the caller may then change the source tensors.
        """
        out: Files = {}
        keep: set[tuple[str, str]] = set()
        cuda = False
        for fname, tensors in files.items():
            out[fname] = {}
            for name, src in tensors.items():
                src = src.detach()
                key = (fname, name)
                keep.add(key)
                buf = self._buffers.get(key)
                pin = src.device.type == "cuda"
                if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or buf.is_pinned() != pin:
                    buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
                    self._buffers[key] = buf
                # non_blocking: from a CUDA tensor into pinned memory the copy is queued on the current stream,
                # so the device keeps running while the host queues the rest; a CPU copy is immediate.
                buf.copy_(src, non_blocking=pin)
                cuda = cuda or pin
                out[fname][name] = buf
        if cuda:
            torch.cuda.current_stream().synchronize()  # every queued copy has landed
        for key in set(self._buffers) - keep:  # tensors no longer saved (a new layout): free their memory
            del self._buffers[key]
        return out

    def release(self) -> None:
        """Free every buffer (the run is over)."""
        self._buffers.clear()


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
