"""GPU probe: the fused expert-wgrad kernels (trainer/kernels/grouped_wgrad_triton.py: pointer and TMA) at the
reference model's shapes, several tile configs, against grouped_mm + add_ into fp32 main_grad. No assertion.

Run: python3 scripts/probes/grouped_wgrad.py
"""

from __future__ import annotations

from typing import Callable

import torch

from trainer.kernels.grouped_wgrad_triton import grouped_wgrad_accumulate_, grouped_wgrad_accumulate_tma_

CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
           (128, 128, 32, 4, 4), (64, 128, 64, 4, 4)]  # fmt: skip
TMA_CONFIGS = [(128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 2), (128, 256, 64, 8, 4),
               (128, 128, 32, 4, 4), (128, 64, 64, 4, 3)]  # fmt: skip


def timed(fn, iters: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    dev, bf = torch.device("cuda"), torch.bfloat16
    E, T = 32, 32768
    counts = torch.distributions.Dirichlet(torch.ones(E) * 4).sample() * T
    counts = counts.floor().long()
    counts[-1] += T - counts.sum()
    offs = torch.cumsum(counts, 0).to(dev)
    offs32 = offs.to(torch.int32)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; E={E}, T={T}, rows/expert {counts.min()}..{counts.max()}")
    for name, M, N in (("fc1 dW [2048, 2048]", 2048, 2048), ("fc2 dW [2048, 1024]", 2048, 1024)):
        a = torch.randn(T, M, device=dev, dtype=bf)
        b = torch.randn(T, N, device=dev, dtype=bf)
        c_offs = torch.arange(E, device=dev, dtype=torch.int64) * (M * N)
        flops = 2 * T * M * N
        base = torch.zeros(E, M, N, device=dev)
        ms = timed(lambda: base.add_(torch._grouped_mm(a.t(), b, offs=offs32)))
        print(f"{name}: grouped_mm bf16 + add_   {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s (GEMM+add)")
        base.zero_()
        base.add_(torch._grouped_mm(a.t(), b, offs=offs32))
        for cfg in CONFIGS:
            c = torch.zeros(E, M, N, device=dev)
            _report(f"{name}: triton {cfg}", c, base, flops,
                    lambda: grouped_wgrad_accumulate_(c, c_offs, a, b, offs, M, N, config=cfg))  # noqa: B023
        rows = torch.arange(E, device=dev, dtype=torch.int64) * M
        for cfg in TMA_CONFIGS:
            c = torch.zeros(E, M, N, device=dev)
            c_RN = c.view(E * M, N)
            _report(f"{name}: triton TMA {cfg}", c, base, flops,
                    lambda: grouped_wgrad_accumulate_tma_(c_RN, rows, a, b, offs, M, N, config=cfg))  # noqa: B023


def _report(label: str, c: torch.Tensor, base: torch.Tensor, flops: int, run: Callable[[], object]) -> None:
    """Run once into `c` (checked against `base`), then time it; or say what failed."""
    try:
        run()
        err = float((c - base).abs().max() / base.abs().max())
        ms = timed(run)
        print(f"{label}  {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  rel err vs bf16 path {err:.1e}")
    except Exception as e:  # noqa: BLE001 - a probe reports what failed
        print(f"{label}  failed: {type(e).__name__}: {str(e)[:100]}")

if __name__ == "__main__":
    main()
