"""Which category of a training step's device time a kernel belongs to: one ordered table of patterns.

A kernel is described by its name, the CPU ops around its launch (innermost first: the op that launched
it, then its callers) and the trainer region it ran for (`trainer/regions.py`; for backward work, the
region of the forward op that made the autograd node). The first rule that matches wins:

    rule            matches (any of)
    comm            kernel nccl/all-gather/reduce-scatter/all-to-all; a c10d/gloo/nccl op around it
    attention       kernel flash/fmha/attention/cudnn; under an aten scaled_dot_product / *_attention op
                    (before the GEMM rule: flash and fmha kernels are cutlass kernels)
    grouped_gemm    launched by aten::_grouped_mm / _scaled_grouped_mm; kernel named grouped gemm
    gemm            launched by mm/addmm/bmm/_scaled_mm/linear/matmul; kernel nvjet, xmma, cutlass, gemm,
                    cublas, gemv, an inductor GEMM template -> grouped_gemm inside moe.experts (the loop
                    backend's per-expert GEMMs too), optimizer inside optimizer.step (Muon's Newton-Schulz),
                    dense_gemm elsewhere
    quantize        kernel quant/amax/fp8/fp4/e4m3/e5m2/mx/transpose (moectl's Triton quantizers by name)
    optimizer       region optimizer.step; kernel multi_tensor_apply / fused adam; a _foreach_ / fused adam op
    grad_accum      region grad.accumulate; under autograd's AccumulateGrad (the post-accumulate hooks)
    router          region moe.router
    dispatch        region moe.dispatch or moe.combine; index/scatter/gather/sort/scan/cumsum in any moe.*
    loss            region model.loss
    copy_cast       kernel copy/Memcpy/Memset/fill/CatArray; a copy_/_to_copy/clone/contiguous/fill_/cat op
    elementwise     everything else (norms, RoPE, activations, residual adds, ...)

Kernels that inductor generates (`triton_poi_/red_/per_...`) are named after the aten ops they fused, e.g.
`triton_red_fused__to_copy_amax_...`: only the region rules apply to them, not the name rules (a fused norm
is not a copy, a fused softmax is not a quantizer), except its GEMM templates (`triton_tem_`).
On the CPU the "kernels" are the outermost aten ops (`aten::linear`, not the `aten::mm` inside): name and
innermost op are the same string, which is why the GEMM rule also takes linear and matmul.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

# key -> label, in the order a table lists them
CATEGORIES: dict[str, str] = {
    "dense_gemm": "dense GEMM",
    "grouped_gemm": "grouped (expert) GEMM",
    "attention": "attention",
    "quantize": "quantize",
    "elementwise": "norm/RoPE/activation/other elementwise",
    "copy_cast": "copy/cast/fill",
    "router": "router (scores, top-k, aux loss)",
    "dispatch": "permute/unpermute, dispatch",
    "loss": "loss (logits cast, cross-entropy)",
    "grad_accum": "grad accumulation into main_grad",
    "optimizer": "optimizer (grad norm, update)",
    "comm": "communication",
}

GENERATED = re.compile(r"^triton_(poi|red|per)_")  # inductor's fused pointwise/reduction kernels
EXPERTS_REGION = "moe.experts"
OPTIMIZER_REGION = "optimizer.step"


@dataclass(frozen=True)
class Rule:
    """One row of the table: a category and the patterns that select it (any one suffices)."""

    category: str  # a CATEGORIES key, or "gemm" (dense or grouped by region)
    kernel: Optional[str] = None  # on the kernel's name (not for inductor-generated kernels)
    op: Optional[str] = None  # on the op that launched it
    within: Optional[str] = None  # on any op around the launch
    region: Optional[str] = None  # on the region (full match)
    only_in_region: Optional[str] = None  # the rule applies only in regions matching this (full match)


RULES: tuple[Rule, ...] = (
    Rule("comm", kernel=r"nccl|all_?gather|reduce_?scatter|all_?reduce|all_?to_?all|sendrecv",
         within=r"^(c10d::|nccl:|gloo:)|record_param_comms"),
    Rule("attention", kernel=r"flash|fmha|attention|sdpa|cudnn", within=r"scaled_dot_product|_attention"),
    Rule("grouped_gemm", op=r"^aten::_(scaled_)?grouped_mm$",
         kernel=r"grouped_?(gemm|mm)|GroupProblemShape|^_(fp8_)?wgrad_kernel(_tma)?$"),  # the last: fused expert wgrads
    Rule("gemm", op=r"^aten::(mm|addmm|bmm|baddbmm|_scaled_mm|_addmm_activation|linear|matmul)$",
         kernel=r"gemm|nvjet|xmma|cutlass|cublas|gemv|^triton_tem_"),
    Rule("quantize", kernel=r"quant|amax|fp8|fp4|e4m3|e5m2|_mx_|_transpose_kernel"),
    Rule("optimizer", region=r"optimizer\.step", kernel=r"multi_tensor_apply|fused_adam",
         op=r"_fused_adamw?_|_foreach_"),
    Rule("grad_accum", region=r"grad\.accumulate", within=r"AccumulateGrad"),
    Rule("router", region=r"moe\.router"),
    Rule("dispatch", region=r"moe\.(dispatch|combine)"),
    Rule("loss", region=r"model\.loss"),
    Rule("dispatch", kernel=r"index|scatter|gather|sort|scan|cumsum|bincount|histogram",
         op=r"index|scatter|gather|sort|cumsum|bincount", only_in_region=r"moe\..*"),
    Rule("copy_cast", kernel=r"copy|Memcpy|Memset|fill|CatArray",
         op=r"^aten::(copy_|_to_copy|clone|contiguous|fill_|zero_|cat|stack)$"),
)  # fmt: skip

# Names are matched case-blind (cub's `DeviceRadixSort...`, cuDNN's upper-case kernels); regions exactly.
_COMPILED = [
    (r, {k: re.compile(getattr(r, k), 0 if "region" in k else re.IGNORECASE)
         for k in ("kernel", "op", "within", "region", "only_in_region") if getattr(r, k) is not None})
    for r in RULES
]  # fmt: skip


def _matches(rule: Rule, pats: dict[str, re.Pattern[str]], name: str, ops: tuple[str, ...], region: str) -> bool:
    if "only_in_region" in pats and not pats["only_in_region"].fullmatch(region):
        return False
    if "region" in pats and pats["region"].fullmatch(region):
        return True
    if "kernel" in pats and name and pats["kernel"].search(name):
        return True
    if "op" in pats and ops and pats["op"].search(ops[0]):
        return True
    return "within" in pats and any(pats["within"].search(op) for op in ops)


def classify(name: str, ops: tuple[str, ...] = (), region: Optional[str] = None) -> str:
    """The CATEGORIES key of one kernel (see the module docstring for the table and its order)."""
    region = region or ""
    pattern_name = "" if GENERATED.match(name) else name
    for rule, pats in _COMPILED:
        if _matches(rule, pats, pattern_name, ops, region):
            if rule.category == "gemm":
                if region == OPTIMIZER_REGION:  # Muon's Newton-Schulz GEMMs: the optimizer's cost
                    return "optimizer"
                return "grouped_gemm" if region == EXPERTS_REGION else "dense_gemm"
            return rule.category
    return "elementwise"
