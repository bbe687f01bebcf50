"""The fp8 columns of `moectl bench grouped-mlp`: moectl's fused expert MLP under its fp8 recipes, and two baselines.

Paths (all compute y = probs * fc2(swiglu(fc1(x))) with fc1/fc2 as fp8 grouped GEMMs, bf16 in and out):
    fp8_tensorwise     moectl's `fused` backend with the fp8 `tensorwise` recipe (trainer/precision): x, w, dy
                       quantized per tensor (per expert / per token group), every GEMM
                       `torch._scaled_grouped_mm` on Hopper; the weights are quantized in every forward
    fp8_tensorwise_pq  the same with the weights quantized once outside the timed call (what the model holds
                       under `fp8_param_gather`: the optimizer quantizes after its step, not every forward)
    fp8_tensorwise_pq_fa  fp8_tensorwise_pq with fast accumulation in the backward GEMMs too
                       (`mixed_precision.fp8_fast_accum_backward`, torchao's choice): the configuration meant
                       to reach issue 6's 1.3x over bf16
    fp8_delayed_pq_fa  the same under the `delayed` recipe (scales from amax histories, which the path fills
                       with one untimed call first; the amax is taken in the quantize pass itself)
    fp8_rowwise        moectl's `fused` backend with the fp8 `rowwise` recipe (torchao's float8 ROWWISE)
    sgmm_rowwise       the baseline a user writes: torchtitan's GroupedExperts with each `torch._grouped_mm`
                       replaced by an fp8 rowwise `torch._scaled_grouped_mm` autograd function (`Fp8RowwiseGroupedMM`
                       below: eager rowwise quantization, pow2 scales, fast accumulation in the 2d x 3d GEMMs as
                       torchao does), eager silu*mul between, probs in fp32: unfused
    te_fp8_tensorwise  moectl's `te` backend (Transformer Engine) under the same tensorwise recipe, run as TE's
                       Float8CurrentScaling quantizers and fp8 grouped GEMMs; weights quantized every call
                       (moectl/bench/te_paths.py says where it runs)
    torchao_rowwise    torchao's MoE fp8 training path: `torchao.prototype.moe_training.
                       _to_fp8_rowwise_then_scaled_grouped_mm` for fc1 and fc2 (Triton quantization kernels),
                       eager silu*mul, probs in fp32; only where torchao imports (it needs CUDA and torch >= 2.11)

Where the device has no native fp8 grouped GEMM (CPU, pre-Hopper) moectl's recipes and the `sgmm_rowwise`
baseline run *emulated* (real fp8 values and scales, dequantized, multiplied in high precision): the table
says so, and such times say nothing about fp8 speed. torchao does not run there.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from moectl.bench import te_paths
from moectl.bench.backend_function import BackendFunction

FP8_PATHS = (
    "fp8_tensorwise", "fp8_tensorwise_pq", "fp8_tensorwise_pq_fa", "fp8_delayed_pq_fa", "fp8_rowwise",
    "sgmm_rowwise", "torchao_rowwise", "te_fp8_tensorwise",
)  # fmt: skip
RECIPE_OF = {
    "fp8_tensorwise": "tensorwise", "fp8_tensorwise_pq": "tensorwise", "fp8_tensorwise_pq_fa": "tensorwise",
    "fp8_delayed_pq_fa": "delayed", "fp8_rowwise": "rowwise", "te_fp8_tensorwise": "tensorwise",
}  # fmt: skip
PRE_QUANTIZED = ("fp8_tensorwise_pq", "fp8_tensorwise_pq_fa", "fp8_delayed_pq_fa")  # weights quantized once
FAST_ACCUM_BACKWARD = ("fp8_tensorwise_pq_fa", "fp8_delayed_pq_fa")
LABELS = {
    "fp8_tensorwise": "ours fp8\ntensorwise",
    "fp8_tensorwise_pq": "ours fp8 tensorwise\nweights pre-quant.",
    "fp8_tensorwise_pq_fa": "ours tensorwise pre-q.\nfast-acc. backward",
    "fp8_delayed_pq_fa": "ours delayed pre-q.\nfast-acc. backward",
    "fp8_rowwise": "ours fp8\nrowwise",
    "sgmm_rowwise": "_scaled_grouped_mm\nrowwise, unfused",
    "torchao_rowwise": "torchao fp8\nrowwise",
    "te_fp8_tensorwise": "TE fp8\ntensorwise",
}
E4M3_MAX = 448.0


def native_grouped_fp8(device: torch.device) -> bool:
    """Whether `torch._scaled_grouped_mm` runs natively here (sm90 / sm100 with this torch)."""
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device) in ((9, 0), (10, 0))


# ----------------------------------------------------------------------------------------------------------
# the unfused baseline: fp8 rowwise torch._scaled_grouped_mm, written directly


def _rowwise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 data of x with one scale per slice along `dim` (pow2, as torchao), and the decode scales
    (keepdim). All-zero slices get scale 1."""
    amax = x.abs().amax(dim=dim, keepdim=True).float()
    scale = torch.where(amax > 0, E4M3_MAX / amax.clamp(min=1e-30), torch.ones_like(amax))
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    data = (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data, scale.reciprocal()


def _per_group_cols(x_TC: torch.Tensor, expert_T: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 data of x `[T, C]` with one scale per (token group, column) along T; decode scales `[G, C]`."""
    amax = torch.zeros(num_groups, x_TC.shape[1], device=x_TC.device, dtype=torch.float32)
    with warnings.catch_warnings():  # "index_reduce() is in beta"
        warnings.simplefilter("ignore", UserWarning)
        amax.index_reduce_(0, expert_T, x_TC.abs().float(), "amax", include_self=True)
    scale = torch.where(amax > 0, E4M3_MAX / amax.clamp(min=1e-30), torch.ones_like(amax))
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    data = (x_TC.float() * scale[expert_T]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data, scale.reciprocal()


def scaled_grouped_mm(
    a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, offs: torch.Tensor,
    out_dtype: torch.dtype, fast_accum: bool, expert_T: Optional[torch.Tensor] = None,
) -> torch.Tensor:  # fmt: skip
    """`torch._scaled_grouped_mm` where native; elsewhere its emulation (dequantize, `torch._grouped_mm` in fp32).

    2d x 3d: a `[T, K]`, sa `[T]`, b `[E, K, N]`, sb `[E, N]`. 2d x 2d: a `[M, T]`, sa `[G * M]`, b `[T, N]`,
    sb `[G * N]` (group-major), `expert_T` the group of each of the T contraction rows (emulation only)."""
    if native_grouped_fp8(a.device):
        return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=out_dtype, use_fast_accum=fast_accum)
    if b.dim() == 3:
        a32 = a.float() * sa[:, None]
        b32 = b.float() * sb[:, None, :]
    else:
        assert expert_T is not None
        G = offs.numel()
        a32 = a.float() * sa.view(G, -1)[expert_T].t()
        b32 = b.float() * sb.view(G, -1)[expert_T]
    return torch._grouped_mm(a32, b32, offs=offs).to(out_dtype)


class Fp8RowwiseGroupedMM(torch.autograd.Function):
    """y `[T, N]` = x `[T, K]` times w[e] `[N, K]`^T per token group, fp8 rowwise (the torchao recipe, eager).

    fprop: x per row along K, w per (expert, row) along K; dgrad: dy per row along N, w per (expert, column)
    along N; wgrad: dy and x per (token group, column) along T. Scales are powers of two."""

    @staticmethod
    def forward(ctx: Any, x_TK, w_ENK, offs_E, expert_T, out_dtype):  # type: ignore[no-untyped-def, override]
        xq, xs = _rowwise(x_TK, -1)
        wq, ws = _rowwise(w_ENK, -1)  # [E, N, K], scales [E, N, 1]
        y = scaled_grouped_mm(xq, wq.transpose(-2, -1), xs.reshape(-1), ws.squeeze(-1), offs_E, out_dtype, True)
        ctx.save_for_backward(x_TK, w_ENK, offs_E, expert_T)
        ctx.out_dtype = out_dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy_TN):  # type: ignore[no-untyped-def, override]
        x_TK, w_ENK, offs_E, expert_T = ctx.saved_tensors
        dy_TN = dy_TN.contiguous()
        G = w_ENK.shape[0]
        gq, gs = _rowwise(dy_TN, -1)
        wtq, wts = _rowwise(w_ENK.transpose(-2, -1).contiguous(), -1)  # [E, K, N] along N, scales [E, K, 1]
        dx = scaled_grouped_mm(gq, wtq.transpose(-2, -1), gs.reshape(-1), wts.squeeze(-1), offs_E, x_TK.dtype, True)
        gcq, gcs = _per_group_cols(dy_TN, expert_T, G)  # [T, N], [G, N]
        xcq, xcs = _per_group_cols(x_TK, expert_T, G)  # [T, K], [G, K]
        dw = scaled_grouped_mm(
            gcq.t().contiguous(), xcq.t().contiguous().t(), gcs.reshape(-1), xcs.reshape(-1), offs_E,
            w_ENK.dtype, False, expert_T,
        )  # fmt: skip
        return dx, dw, None, None, None


def sgmm_expert_mlp(x_TD, w1_EHD, w2_EDF, offs_E, expert_T, probs_T):  # type: ignore[no-untyped-def]
    """torchtitan's GroupedExperts with fp8 rowwise scaled grouped GEMMs (unfused; see the module docstring)."""
    h_TH = Fp8RowwiseGroupedMM.apply(x_TD, w1_EHD, offs_E, expert_T, x_TD.dtype)
    g_TF, u_TF = h_TH.chunk(2, dim=-1)
    y_TD = Fp8RowwiseGroupedMM.apply(F.silu(g_TF) * u_TF, w2_EDF, offs_E, expert_T, x_TD.dtype)
    return (y_TD.float() * probs_T[:, None]).to(y_TD.dtype)


# ----------------------------------------------------------------------------------------------------------
# torchao


def torchao_fn() -> tuple[Optional[Callable[..., torch.Tensor]], str]:
    """(torchao's fp8 rowwise grouped GEMM, its version) or (None, why not)."""
    try:
        import torchao  # type: ignore[import-not-found]
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm  # type: ignore
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here", reported as such
        return None, f"torchao not available ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    return _to_fp8_rowwise_then_scaled_grouped_mm, f"torchao {getattr(torchao, '__version__', '?')}"


def torchao_expert_mlp(mm, x_TD, w1_EHD, w2_EDF, offs_E, probs_T):  # type: ignore[no-untyped-def]
    """torchao's fp8 rowwise grouped GEMM (B_t column-major, as it asks) for fc1 and fc2, eager SwiGLU, probs."""
    h_TH = mm(x_TD, w1_EHD.transpose(-2, -1), offs_E, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)
    g_TF, u_TF = h_TH.chunk(2, dim=-1)
    y_TD = mm(F.silu(g_TF) * u_TF, w2_EDF.transpose(-2, -1), offs_E, out_dtype=torch.bfloat16,
              pad_token_groups_for_grouped_mm=False)  # fmt: skip
    return (y_TD.float() * probs_T[:, None]).to(y_TD.dtype)


# ----------------------------------------------------------------------------------------------------------
# moectl's recipes


def recipe_for(path: str) -> Any:
    from trainer.precision.recipes import DelayedRecipe, RowwiseRecipe, TensorwiseRecipe

    cls = {"tensorwise": TensorwiseRecipe, "delayed": DelayedRecipe, "rowwise": RowwiseRecipe}[RECIPE_OF[path]]
    return cls(fp8_format="e4m3", fast_accum_backward=path in FAST_ACCUM_BACKWARD)


def recipe_mode(path: str, device: torch.device) -> str:
    """'native' when every grouped GEMM of the path's recipe has a native kernel on `device`, else 'emulated'."""
    if path == "te_fp8_tensorwise":
        return "native"  # TE's own fp8 GEMMs (the column runs only where TE does)
    if path in RECIPE_OF:
        gemms = recipe_for(path).native_gemms(device)
        return "native" if all(gemms[f"grouped.{g}"] for g in ("fprop", "dgrad", "wgrad")) else "emulated"
    if path == "sgmm_rowwise":
        return "native" if native_grouped_fp8(device) else "emulated"
    return "native"  # torchao: runs only where it imports and has its kernels


def expert_fn(path: str, inp: Any, spec: Any) -> tuple[Callable[..., torch.Tensor], list[torch.Tensor]]:
    """(fn(x, probs) -> y, the weight leaves) for one fp8 path; `inp` is grouped_mlp._Inputs."""
    w1, w2 = inp.w1_EHD, inp.w2_EDF
    if path == "sgmm_rowwise":
        expert_T = torch.repeat_interleave(
            torch.arange(inp.counts_E.numel(), device=inp.counts_E.device), inp.counts_E
        )  # fmt: skip
        return (lambda x, p: sgmm_expert_mlp(x, w1, w2, inp.offs_E, expert_T, p)), [w1, w2]
    if path == "torchao_rowwise":
        mm, why = torchao_fn()
        if mm is None:
            raise RuntimeError(why)
        return (lambda x, p: torchao_expert_mlp(mm, x, w1, w2, inp.offs_E, p)), [w1, w2]
    from trainer.moe.backends import get_backend
    from trainer.moe.expert_precision import ExpertPrecision

    recipe = recipe_for(path)
    delayed = recipe.name == "delayed"
    backend = get_backend("te" if path == "te_fp8_tensorwise" else "fused", inp.x_TD.device)
    given: dict[str, Any] = {}
    if path in PRE_QUANTIZED:  # quantized once, outside the timed calls (fp8 param gather's weights)
        given = {"fc1": _prequantize(recipe, w1), "fc2": _prequantize(recipe, w2)}
    states: dict[str, Any] = {}  # delayed: the activation and grad histories live across calls, as in training

    def make() -> Any:
        return ExpertPrecision(recipe, states if delayed else {}, True, dict(given))

    def fn(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return BackendFunction.apply(x, w1, w2, p, inp.counts_E, backend, spec, make)

    if delayed:  # one untimed call fills the histories, so every measured call uses scales from real amaxes
        x0 = inp.x_TD.detach().requires_grad_()
        y0 = fn(x0, inp.probs_T.detach())
        gen = torch.Generator(device=y0.device).manual_seed(1)
        torch.autograd.grad(y0, [x0], torch.randn(y0.shape, generator=gen, device=y0.device, dtype=y0.dtype))
    return fn, [w1, w2]


def _prequantize(recipe: Any, w: torch.Tensor) -> Any:
    """A grouped weight quantized once; under delayed scaling with a weight history that has seen the weight
    (a first quantization records its amax, the second uses FP8_MAX / amax), as after a few training steps."""
    state = recipe.new_state(w.shape[0])
    if state is not None:
        recipe.quantize_weight(w.detach(), state=state)
    return recipe.quantize_weight(w.detach(), state=state)


def available(path: str, device: torch.device) -> tuple[bool, str]:
    """Whether `path` can run on `device`, and if not, why (said in the table's notes)."""
    if path in te_paths.TE_PATHS:
        return te_paths.available(path, device)
    if path == "torchao_rowwise":
        if device.type != "cuda":
            return False, "torchao fp8 rowwise: not run on cpu (torchao's MoE fp8 path needs CUDA)"
        mm, why = torchao_fn()
        if mm is None:
            return False, f"torchao fp8 rowwise: not run: {why}"
        if not native_grouped_fp8(device):
            return False, "torchao fp8 rowwise: not run (no native torch._scaled_grouped_mm on this device)"
        return True, why
    return True, ""


# ----------------------------------------------------------------------------------------------------------
# a kernel-time profile (bytes vs FLOPs: which share of a call is GEMMs)

_GEMM_HINTS = ("gemm", "cutlass", "nvjet", "xmma", "cublas", "wgmma", "sm90_", "aten::mm", "aten::bmm",
               "aten::_grouped_mm", "aten::_scaled_grouped_mm", "aten::_scaled_mm", "aten::addmm")  # fmt: skip


def is_gemm(name: str) -> bool:
    low = name.lower()
    return any(h in low for h in _GEMM_HINTS)


def kernel_profile(fn: Callable[[], object], device: torch.device, calls: int = 3, top: int = 12) -> dict[str, Any]:
    """Device time per kernel over `calls` calls (CUDA kernels; on CPU, aten ops' self time), split into
    GEMM kernels and the rest (quantization, activation, copies: the memory-bound part)."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    kernels: dict[str, float] = {}
    for ev in prof.events():
        if device.type == "cuda":
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = ev.time_range.elapsed_us()  # a kernel's own span on the device
        else:
            if not ev.name.startswith("aten::"):
                continue
            us = ev.self_cpu_time_total
        kernels[ev.name] = kernels.get(ev.name, 0.0) + us / 1e3 / calls
    total = sum(kernels.values())
    gemm = sum(v for k, v in kernels.items() if is_gemm(k))
    rows = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return {
        "total_ms": total, "gemm_ms": gemm, "other_ms": total - gemm, "kernels": len(kernels),
        "top": [{"name": k[:110], "ms": v, "gemm": is_gemm(k)} for k, v in rows],
    }  # fmt: skip
