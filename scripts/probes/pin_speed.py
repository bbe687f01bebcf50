"""Seconds to allocate pinned host memory: one 6 GiB tensor, then 48 tensors of 128 MiB (the shape of the old
per-tensor staging), a 6 GiB device-to-host copy into it, under whatever PYTORCH_CUDA_ALLOC_CONF is set; then
the 12 GiB `HostArena` a background save now stages in, and a copy into it. From the repo root:

    PYTHONPATH=. python3 scripts/probes/pin_speed.py
    PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 \
        PYTHONPATH=. python3 scripts/probes/pin_speed.py
"""

import os
import time

import torch

torch.cuda.init()
t0 = time.perf_counter(); a = torch.empty(6 << 30, dtype=torch.uint8, pin_memory=True); t1 = time.perf_counter()
bs = [torch.empty(128 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(48)]; t2 = time.perf_counter()
src = torch.empty(6 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize(); t3 = time.perf_counter(); a.copy_(src, non_blocking=True); torch.cuda.synchronize(); t4 = time.perf_counter()
print(f"conf={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r}: 6 GiB one tensor {t1-t0:.2f} s, 48 x 128 MiB {t2-t1:.2f} s, "
      f"D2H 6 GiB {t4-t3:.2f} s ({6/(t4-t3):.1f} GiB/s)")

# The staging arena a background save now allocates (ckpt/host_arena.py): one exactly sized mapping, pages
# touched on io_threads() threads, registered in one call; then a device-to-host copy into it.
from ckpt.host_arena import HostArena  # noqa: E402
from ckpt.shard_io import io_threads  # noqa: E402

del a, bs
n = 12 << 30  # about one rank's share at the reference size on 2 GPUs (12.8 GB)
t0 = time.perf_counter(); arena = HostArena(n, pin=True, threads=io_threads()); t1 = time.perf_counter()
src = torch.empty(6 << 30, dtype=torch.uint8, device="cuda")
dst = arena.buffer[: 6 << 30]
torch.cuda.synchronize(); t2 = time.perf_counter(); dst.copy_(src, non_blocking=True); torch.cuda.synchronize(); t3 = time.perf_counter()
print(f"HostArena 12 GiB ({arena.how}, {io_threads()} threads): {t1-t0:.2f} s; D2H 6 GiB into it {t3-t2:.2f} s "
      f"({6/(t3-t2):.1f} GiB/s)")
arena.release()
