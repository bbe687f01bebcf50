"""Seconds to allocate pinned host memory: one 6 GiB tensor, then 48 tensors of 128 MiB (the shape of a
staging save), and a 6 GiB device-to-host copy into it, under whatever PYTORCH_CUDA_ALLOC_CONF is set:

    python3 scripts/probes/pin_speed.py
    PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 \
        python3 scripts/probes/pin_speed.py
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
