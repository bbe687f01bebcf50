"""Side CUDA streams: one per GPU and purpose, made on first use and reused (streams are not free).

Work that overlaps the current stream runs on one: the fused expert backend's weight-grad GEMMs (`wgrad`)
and Muon's elementwise passes beside its Newton-Schulz GEMMs (`muon`). Each purpose keeps a stream of its
own, so neither queues behind the other's work.
"""

from __future__ import annotations

import torch

_STREAMS: dict[tuple[int, str], "torch.cuda.Stream"] = {}


def side_stream(device: torch.device, purpose: str) -> "torch.cuda.Stream":
    """The side stream of `purpose` on `device` (a CUDA device; no index: the current one)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, purpose)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=index)
    return _STREAMS[key]
