"""GPU probe: the `te` expert backend against `fused`, stage by stage, with prints a first failure can be read
from. No assertion stops it: every case prints its errors (or its traceback) and the run goes on; the last
line says how many cases were over their bound.

Stages, each in its own try block: TE's import and version; the raw TE calls the backend makes (one grouped
GEMM per layout, each scaled activation, one fp8 split-quantize), each against plain torch; then the backend
vs fused (bf16 and fp8 tensorwise; interleave off / native 64 / converted 8; uneven and empty experts;
biases and probs; main_grad accumulation; delayed wgrad); then a timing of both at one mid-size shape.

Run: python3 scripts/probes/te_backend_smoke.py        (after scripts/gpu_te_setup.sh installed TE)
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

BAD: list[str] = []
D, F = 256, 384
NAMES = ("y", "dx", "dw1", "db1", "dw2", "db2", "dprobs")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    den = b64.norm().item()
    return (a64 - b64).norm().item() / den if den else (a64 - b64).norm().item()


def check(label: str, got: torch.Tensor, want: torch.Tensor, bound: float) -> None:
    finite = bool(torch.isfinite(got).all())
    err = rel(got, want) if finite else float("nan")
    ok = finite and err < bound
    print(f"  {'ok ' if ok else 'BAD'} {label:<44} rel err {err:.2e} (bound {bound:.0e})", flush=True)
    if not ok:
        BAD.append(label)


def stage(name: str, fn: Callable[[], Any]) -> Any:
    print(f"== {name}", flush=True)
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a probe reports and goes on
        print(traceback.format_exc(), flush=True)
        BAD.append(name)
        return None


def env() -> Any:
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, {torch.cuda.get_device_name()} "
          f"sm{''.join(map(str, torch.cuda.get_device_capability()))}")  # fmt: skip
    from trainer.moe.backends.te_runtime import load_te

    te = load_te()
    import transformer_engine_torch as tex

    print(f"transformer_engine {te.version}; cuBLASLt {tex.get_cublasLt_version()}; "
          f"extension {Path(tex.__file__).name}")  # fmt: skip
    return te


def raw_calls(te: Any) -> None:
    """Each TE entry point the backend uses, once, against torch."""
    from trainer.moe import expert_math

    g = torch.Generator(device="cuda").manual_seed(0)
    m = [64, 0, 32]
    x = torch.randn(96, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(3, 128, D, device="cuda", generator=g) / D**0.5).bfloat16()
    b = torch.randn(3, 128, device="cuda", generator=g).bfloat16()
    y = torch.empty(96, 128, device="cuda", dtype=torch.bfloat16)
    te.general_grouped_gemm(list(w.unbind(0)), list(torch.split(x, m)), [y], [None] * 3, torch.bfloat16,
                            layout="TN", m_splits=m, single_output=True, bias=list(b.unbind(0)), use_bias=True)  # fmt: skip
    ref = torch.cat([x[:64].float() @ w[0].float().t() + b[0].float(), x[64:].float() @ w[2].float().t() + b[2].float()])
    check("grouped GEMM TN (fprop + bias)", y, ref, 1e-2)
    dy = torch.randn(96, 128, device="cuda", generator=g).bfloat16()
    dx = torch.empty(96, D, device="cuda", dtype=torch.bfloat16)
    te.general_grouped_gemm(list(w.unbind(0)), list(torch.split(dy, m)), [dx], [None] * 3, torch.bfloat16,
                            layout="NN", m_splits=m, single_output=True, grad=True)  # fmt: skip
    check("grouped GEMM NN (dgrad)", dx, torch.cat([dy[:64].float() @ w[0].float(), dy[64:].float() @ w[2].float()]), 1e-2)
    main = [torch.full((128, D), 1.0, device="cuda") for _ in range(3)]
    te.general_grouped_gemm(list(torch.split(x, m)), list(torch.split(dy, m)), main, [None] * 3, torch.float32,
                            layout="NT", m_splits=m, grad=True, accumulate=True)  # fmt: skip
    check("grouped GEMM NT (wgrad into fp32, accumulate)", main[0], 1.0 + dy[:64].float().t() @ x[:64].float(), 1e-2)
    check("  the empty expert's target left as it was", main[1], torch.ones(128, D, device="cuda"), 1e-7)
    h = torch.randn(96, 2 * F, device="cuda", generator=g).bfloat16()
    p = torch.rand(96, device="cuda", generator=g)
    da = torch.randn(96, F, device="cuda", generator=g).bfloat16()
    from trainer.moe.backends import te_activation as act

    for name, interleave in (("swiglu", None), ("swiglu", 64), ("swiglu", 8), ("quick_geglu", None),
                             ("quick_geglu", 64), ("squared_relu", None)):  # fmt: skip
        hh = h[:, :F].contiguous() if name == "squared_relu" else h
        a = act.act_forward(te.tex, hh, p, name, interleave)
        check(f"{name} I={interleave} forward", a, expert_math.fused_forward(hh.float(), p, name, interleave), 1e-2)
        dh, dp = act.act_backward(te.tex, da, hh, p, name, interleave, scale_grad=True)
        dh_ref, dp_ref, _ = expert_math.fused_backward(hh.float(), p, da.float(), name, interleave)
        check(f"{name} I={interleave} backward dh", dh, dh_ref, 1e-2)
        check(f"{name} I={interleave} backward dprobs", dp, dp_ref, 1e-2)
    from trainer.moe.backends.te_gemm import Fp8Operands
    from trainer.precision import TensorwiseRecipe

    ops = Fp8Operands(te, TensorwiseRecipe(), torch.device("cuda"))
    xq = ops.activation(x, [64, 0, 32], columnwise=True)
    print(f"  split_quantize -> {type(xq[0]).__name__}, dequantized rel err "
          f"{rel(xq[0].dequantize(dtype=torch.float32), x[:64].float()):.2e} (e4m3: ~2e-2)")  # fmt: skip


def problem(counts: list[int], bias: bool, seed: int, activation: str = "swiglu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    e, t, h = len(counts), sum(counts), F if activation == "squared_relu" else 2 * F

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()

    return (randn(t, D), randn(e, h, D, scale=D**-0.5), randn(e, h, scale=0.1) if bias else None,
            randn(e, D, F, scale=F**-0.5), randn(e, D, scale=0.1) if bias else None,
            torch.rand(t, device="cuda", generator=g) + 0.05, randn(t, D))  # fmt: skip


def versus_fused(te: Any) -> None:
    from trainer.moe.backends.fused import FusedBackend
    from trainer.moe.backends.te import TEBackend
    from trainer.moe.expert_precision import ExpertPrecision
    from trainer.precision import TensorwiseRecipe

    backend = TEBackend("cuda")
    cases = [("bf16", None, [128, 0, 77, 1, 300, 0, 33, 61]), ("fp8 e4m3", "e4m3", [256, 0, 48, 512, 16]),
             ("fp8 hybrid", "hybrid", [256, 0, 48, 512, 16])]  # fmt: skip
    for label, fmt, counts in cases:
        for activation, interleave in (("swiglu", None), ("swiglu", 64), ("swiglu", 8), ("quick_geglu", 64),
                                       ("squared_relu", None)):  # fmt: skip
            for bias in (False, True):
                name = f"{label} {activation} I={interleave} bias={bias}"
                try:
                    x, w1, b1, w2, b2, probs, dy = problem(counts, bias, 3, activation)
                    spec = SimpleNamespace(activation=activation, glu_interleave_size=interleave, ffn_size=F)
                    c = torch.tensor(counts, device="cuda")
                    kw = lambda: {} if fmt is None else {"precision": ExpertPrecision(TensorwiseRecipe(fmt))}  # noqa: E731
                    y, ctx = backend.forward(x, w1, b1, w2, b2, c, probs, spec, **kw())
                    got = [y, *backend.backward(ctx, dy)]
                    yf, ctxf = FusedBackend("cuda").forward(x, w1, b1, w2, b2, c, probs, spec, **kw())
                    ref = [yf, *FusedBackend("cuda").backward(ctxf, dy)]
                    print(f"  -- {name}")
                    for n, a, b in zip(NAMES, got, ref):
                        if b is not None:
                            check(f"{n} te vs fused", a, b, 1e-2 if fmt is None else 5e-2)
                except Exception:  # noqa: BLE001
                    print(f"  BAD {name}\n{traceback.format_exc()}", flush=True)
                    BAD.append(name)
    x, w1, b1, w2, b2, probs, dy = problem([64, 0, 96], True, 5)
    spec = SimpleNamespace(activation="swiglu", glu_interleave_size=None, ffn_size=F)
    c = torch.tensor([64, 0, 96], device="cuda")
    plain = backend.backward(backend.forward(x, w1, b1, w2, b2, c, probs, spec)[1], dy)
    start1, start2 = torch.randn_like(w1.float()), torch.randn_like(w2.float())
    into = (list(start1.clone().unbind(0)), list(start2.clone().unbind(0)))
    backend.backward(backend.forward(x, w1, b1, w2, b2, c, probs, spec)[1], dy, wgrad_into=into)
    check("main_grad fc1 (accumulated into fp32)", torch.stack(into[0]), start1 + plain[1].float(), 1e-2)
    check("main_grad fc2 (accumulated into fp32)", torch.stack(into[1]), start2 + plain[3].float(), 1e-2)
    dx, dp, wgrad = backend.backward_dgrad(backend.forward(x, w1, b1, w2, b2, c, probs, spec)[1], dy)
    dw1, _, dw2, _ = wgrad()
    same = torch.equal(dx, plain[0]) and torch.equal(dw1, plain[1]) and torch.equal(dw2, plain[3])
    print(f"  {'ok ' if same else 'BAD'} delayed wgrad bitwise the plain backward", flush=True)
    if not same:
        BAD.append("delayed wgrad")


def timing() -> None:
    from trainer.moe.backends.fused import FusedBackend
    from trainer.moe.backends.te import TEBackend

    counts = [1024] * 32
    x, w1, _, w2, _, probs, dy = problem(counts, False, 9)
    x = torch.randn(sum(counts), 4096, device="cuda").bfloat16()
    w1 = (torch.randn(32, 2 * 1536, 4096, device="cuda") / 64).bfloat16()
    w2 = (torch.randn(32, 4096, 1536, device="cuda") / 40).bfloat16()
    dy = torch.randn_like(x)
    spec = SimpleNamespace(activation="swiglu", glu_interleave_size=None, ffn_size=1536)
    c = torch.tensor(counts, device="cuda")
    for backend in (FusedBackend("cuda"), TEBackend("cuda")):
        def step() -> None:
            backend.backward(backend.forward(x, w1, None, w2, None, c, probs, spec)[1], dy)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            step()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 10
        flops = 3 * 2 * sum(counts) * 4096 * 3 * 1536
        print(f"  {backend.name:<6} fwd+bwd E=32 h=4096 f=1536 m=1024: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s "
              "(a rough probe; `moectl bench grouped-mlp` is the measurement)", flush=True)  # fmt: skip


def main() -> None:
    te = stage("environment and TE import", env)
    if te is None:
        print("te_smoke: TE did not import; nothing else can run")
        sys.exit(1)
    stage("raw TE calls vs torch", lambda: raw_calls(te))
    stage("te backend vs fused", lambda: versus_fused(te))
    stage("timing (one shape)", timing)
    print(f"te_smoke: {'all ok' if not BAD else f'{len(BAD)} over their bound: ' + ', '.join(BAD)}")
    sys.exit(1 if BAD else 0)


if __name__ == "__main__":
    main()
