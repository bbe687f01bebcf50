"""Full (unsharded) per-param optimizer state from bucket shards: what checkpoints save.

Shared by every optimizer over `DistributedModel` buffers (AdamW's `DistributedOptimizer`, Muon's
`LayerWiseMuon`): their shards differ in how they cut buckets, but each holds one fp32 tensor per state
key covering `[shard.lo, shard.hi)` of its bucket, or the whole bucket when unsharded.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from trainer.parallel import comm


@torch.no_grad()
def gather_logical_state(shards: Iterable[Any], state_keys: tuple[str, ...], step: int,
                         device: torch.device) -> dict[str, Any]:  # fmt: skip
    """`{"step", "params": {name: {key: fp32 tensor of the param's shape}}}`, on every rank (collective).

    Each shard exposes `.bucket` and one attribute per state key. Expert entries cover this ep rank's
    experts only (their buckets reduce over expert-dp).
    """
    out: dict[str, Any] = {"step": step, "params": {}}
    for s in shards:
        b = s.bucket
        fulls = {}
        for key in state_keys:
            t = getattr(s, key)
            if t.numel() == b.numel:
                fulls[key] = t
            else:
                full = torch.empty(b.numel, dtype=torch.float32, device=device)
                comm.all_gather(full, t, b.group)
                fulls[key] = full
        for p in b.params:
            a, e = b.param_ranges[p]
            out["params"][b.buffer.names[p]] = {k: fulls[k][a:e].view(p.shape).clone() for k in state_keys}
    return out
