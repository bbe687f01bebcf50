"""Where the fused expert MLP's time goes: each stage timed alone, with its FLOPs or bytes against the ceilings.

Run: `python -m moectl.bench.fused_breakdown [E,h,f,m ...]` (CUDA). For every shape it prints one line per
stage of `FusedBackend` (fc1/fc2 forward GEMMs, the two activation kernels, dgrad and wgrad GEMMs), the
alternatives that were tried for a stage (wgrad operand order, activation launch tiles, wgrad overlapped with
dgrad on a second stream), and the whole backend call. GEMMs read as TFLOP/s, the activation kernels as
GB/s of the bytes they must move (each input read once, each output written once).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import torch

from moectl.bench.grouped_mlp import DEFAULT_SHAPES, Shape
from moectl.bench.timing import dense_ceiling_tflops, median_ms


def _copy_gbps(device: torch.device, warmup: int, iters: int) -> float:
    """Device-to-device copy bandwidth (bytes read + written), the memory ceiling."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), device, warmup, iters)
    return 2 * a.numel() / (ms * 1e-3) / 1e9


def stages(shape: Shape, device: torch.device, warmup: int = 3, iters: int = 10) -> list[dict[str, Any]]:
    """Time each stage of the fused backend (and the tried alternatives) at one shape."""
    from trainer.kernels import glu_triton
    from trainer.moe.backends.fused import FusedBackend
    from trainer.moe.expert_math import ExpertSpec

    E, D, Fd, T = shape.experts, shape.hidden, shape.ffn, shape.rows
    H = 2 * Fd
    dt = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, device=device, generator=g) * scale).to(dt)

    x, dy = randn(T, D), randn(T, D)
    w1, w2 = randn(E, H, D, scale=D**-0.5), randn(E, D, Fd, scale=Fd**-0.5)
    probs = torch.rand(T, device=device, generator=g)
    counts = torch.full((E,), shape.tokens_per_expert, device=device, dtype=torch.int64)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(x, w1.transpose(-2, -1), offs)
    a = glu_triton.glu_forward(h, probs, "swiglu")
    da = torch._grouped_mm(dy, w2, offs)
    dh, _, _ = glu_triton.glu_backward(h, probs, da, "swiglu")
    rows: list[dict[str, Any]] = []

    def add(name: str, fn: Callable[[], object], flops: float = 0.0, nbytes: float = 0.0) -> None:
        ms = median_ms(fn, device, warmup, iters)
        row: dict[str, Any] = {"shape": shape.label(), "stage": name, "ms": ms}
        if flops:
            row["tflops"] = flops / (ms * 1e-3) / 1e12
        if nbytes:
            row["gbps"] = nbytes / (ms * 1e-3) / 1e9
        rows.append(row)

    mm = lambda m, n, k: 2.0 * m * n * k  # noqa: E731
    add("fc1 fwd gmm(x, w1^T)", lambda: torch._grouped_mm(x, w1.transpose(-2, -1), offs), mm(T, H, D))
    add("fc2 fwd gmm(a, w2^T)", lambda: torch._grouped_mm(a, w2.transpose(-2, -1), offs), mm(T, D, Fd))
    add("fc2 dgrad gmm(dy, w2)", lambda: torch._grouped_mm(dy, w2, offs), mm(T, Fd, D))
    add("fc1 dgrad gmm(dh, w1)", lambda: torch._grouped_mm(dh, w1, offs), mm(T, D, H))
    add("fc2 wgrad gmm(dy^T, a) [used]", lambda: torch._grouped_mm(dy.t(), a, offs), mm(D, Fd, T))
    add("fc2 wgrad gmm(a^T, dy)^T", lambda: torch._grouped_mm(a.t(), dy, offs).transpose(-2, -1), mm(D, Fd, T))
    add("fc1 wgrad gmm(dh^T, x) [used]", lambda: torch._grouped_mm(dh.t(), x, offs), mm(H, D, T))
    add("fc1 wgrad gmm(x^T, dh)^T", lambda: torch._grouped_mm(x.t(), dh, offs).transpose(-2, -1), mm(H, D, T))

    side = torch.cuda.Stream(device)

    def dgrad_wgrad_overlapped() -> None:
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            torch._grouped_mm(dh.t(), x, offs)
        torch._grouped_mm(dh, w1, offs)
        torch.cuda.current_stream(device).wait_stream(side)

    add("fc1 dgrad+wgrad sequential", lambda: (torch._grouped_mm(dh, w1, offs), torch._grouped_mm(dh.t(), x, offs)),
        mm(T, D, H) * 2)  # fmt: skip
    add("fc1 dgrad+wgrad two streams", dgrad_wgrad_overlapped, mm(T, D, H) * 2)

    fwd_bytes = T * (H + Fd) * 2 + T * 4
    bwd_bytes = T * (H + Fd + H + Fd) * 2 + T * 8
    for tile in (None, glu_triton.Tile(16, 256), glu_triton.Tile(8, 512), glu_triton.Tile(64, 128, 8),
                 glu_triton.Tile(32, 64)):  # fmt: skip
        label = "default" if tile is None else f"{tile.rows}x{tile.cols}w{tile.warps}"
        add(f"glu fwd [{label}]", lambda t=tile: glu_triton.glu_forward(h, probs, "swiglu", tile=t), nbytes=fwd_bytes)
    for tile in (None, glu_triton.Tile(8, 256), glu_triton.Tile(4, 512), glu_triton.Tile(32, 128, 8),
                 glu_triton.Tile(16, 64), glu_triton.Tile(8, 128)):  # fmt: skip
        label = "default" if tile is None else f"{tile.rows}x{tile.cols}w{tile.warps}"
        add(f"glu bwd [{label}]", lambda t=tile: glu_triton.glu_backward(h, probs, da, "swiglu", tile=t),
            nbytes=bwd_bytes)  # fmt: skip

    spec = ExpertSpec("swiglu", Fd, None)
    backend = FusedBackend(device)

    def whole() -> None:
        y, ctx = backend.forward(x, w1, None, w2, None, counts, probs, spec)
        backend.backward(ctx, dy)

    add("fused fwd+bwd (backend calls)", whole, shape.gemm_flops(True))
    return rows


def main(argv: list[str]) -> None:
    device = torch.device("cuda")
    shapes = [Shape.parse(s) for s in argv] or list(DEFAULT_SHAPES)
    ceiling = dense_ceiling_tflops(device, torch.bfloat16, 8192, 5, 20)
    copy = _copy_gbps(device, 3, 10)
    print(f"ceilings: dense bf16 {ceiling:.0f} TFLOP/s, copy {copy:.0f} GB/s", flush=True)
    out: list[dict[str, Any]] = []
    for shape in shapes:
        for row in stages(shape, device):
            rate = f"{row['tflops']:.0f} TFLOP/s" if "tflops" in row else f"{row.get('gbps', 0):.0f} GB/s"
            print(f"{row['shape']:<32} {row['stage']:<34} {row['ms']:8.3f} ms  {rate}", flush=True)
            out.append(row)
        torch.cuda.empty_cache()
    print(json.dumps({"ceiling_tflops": ceiling, "copy_gbps": copy, "rows": out}))


if __name__ == "__main__":
    main(sys.argv[1:])
