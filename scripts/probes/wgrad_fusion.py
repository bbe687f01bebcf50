"""GPU probe: can weight grads accumulate into fp32 main_grad inside the GEMM on this torch, and what does
each way cost at the reference model's shapes? Prints one table; no assertion (a probe, not a test).

Ways, per weight-grad GEMM of a bf16 step with fp32 main_grad:
  unfused    mm -> bf16 grad, then main_grad.add_(grad)               (today's default)
  addmm      torch.addmm(main_grad, dy^T, x, out_dtype=fp32, out=main_grad): cuBLAS beta=1 into fp32
  grouped    torch._grouped_mm(dy^T, x, offs) bf16, then main_grad.add_ (today's experts)
  grouped32  torch._grouped_mm(..., out_dtype=fp32), then add_
  loop       per-expert addmm into each expert's main_grad slice

Run: python3 scripts/probes/wgrad_fusion.py
"""

from __future__ import annotations

import torch


def timed(fn, iters: int = 20) -> float:
    for _ in range(3):
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
    dev = torch.device("cuda")
    bf = torch.bfloat16
    rows = []
    # dense: qkv of the reference model (d=2048, 16 heads, 4 groups: 3072 rows), T = 2 x 4096 tokens
    T, D, O = 8192, 2048, 3072
    x, dy = torch.randn(T, D, device=dev, dtype=bf), torch.randn(T, O, device=dev, dtype=bf)
    mg = torch.zeros(O, D, device=dev)
    ref = (dy.float().t() @ x.float())
    rows.append(("dense unfused", timed(lambda: mg.add_(dy.t() @ x)), None))
    try:
        mg.zero_()
        torch.addmm(mg, dy.t(), x, out_dtype=torch.float32, out=mg)
        err = float((mg - ref).abs().max() / ref.abs().max())
        rows.append(("dense addmm out_dtype", timed(lambda: torch.addmm(mg, dy.t(), x, out_dtype=torch.float32, out=mg)), err))
    except Exception as e:  # noqa: BLE001 - a probe reports what the build lacks
        rows.append((f"dense addmm out_dtype: {type(e).__name__}: {str(e)[:80]}", float("nan"), None))
    # experts: 32 experts, ffn 1024 (fc1 2048 rows), T*K = 32768 routings, uneven split
    E, F, N = 32, 1024, 32768
    counts = torch.distributions.Dirichlet(torch.ones(E)).sample() * N
    counts = counts.floor().long()
    counts[-1] += N - counts.sum()
    offs = torch.cumsum(counts, 0).to(device=dev, dtype=torch.int32)
    xe, dh = torch.randn(N, D, device=dev, dtype=bf), torch.randn(N, 2 * F, device=dev, dtype=bf)
    mge = torch.zeros(E, 2 * F, D, device=dev)
    rows.append(("grouped bf16 + add_", timed(lambda: mge.add_(torch._grouped_mm(dh.t(), xe, offs=offs))), None))
    try:
        rows.append(("grouped out_dtype fp32 + add_",
                     timed(lambda: mge.add_(torch._grouped_mm(dh.t(), xe, offs=offs, out_dtype=torch.float32))), None))
    except Exception as e:  # noqa: BLE001
        rows.append((f"grouped out_dtype: {type(e).__name__}: {str(e)[:80]}", float("nan"), None))
    bounds = [0] + torch.cumsum(counts, 0).tolist()

    def loop() -> None:
        for e in range(E):
            a, b = bounds[e], bounds[e + 1]
            torch.addmm(mge[e], dh[a:b].t(), xe[a:b], out_dtype=torch.float32, out=mge[e])

    try:
        rows.append(("per-expert addmm out_dtype", timed(loop), None))
    except Exception as e:  # noqa: BLE001
        rows.append((f"per-expert addmm: {type(e).__name__}: {str(e)[:80]}", float("nan"), None))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for name, ms, err in rows:
        print(f"{name:40s} {ms:8.3f} ms" + (f"   rel err {err:.2e}" if err is not None else ""))


if __name__ == "__main__":
    main()
