"""The `te` expert-MLP backend: Transformer Engine's grouped GEMMs around its row-scaled activation kernel.

Legend: T routed rows (grouped by expert), D model width, H fc1 width (2F gated), F expert ffn width,
E experts. Weights are `[E, out, in]`: w1_EHD, w2_EDF; biases b1_EH, b2_ED. Computes, per the protocol
(`__init__.py`), y = probs * (fc2(act(fc1(x) + b1)) + b2) as

    h_TH = TE grouped fprop(x, w1) + b1[expert]     (bias in the GEMM epilogue; h kept for backward)
    a_TF = probs * act(h)                           (te_activation.py: one TE kernel, fp32 math)
    y_TD = TE grouped fprop(a, w2) [+ probs * b2[expert]]

and backward: da = dgrad(dy, w2); one TE kernel gives dh and dprobs from (da, h, probs); dx = dgrad(dh, w1);
dw2 = wgrad(dy, a), dw1 = wgrad(dh, x) (te_gemm.py). The GEMMs are `general_grouped_gemm`, what
`te.GroupedLinear` runs; the probs sit on fc2's input as in the `fused` backend (expert_math says why), so
the two backends compute the same function with the same roundings except the GEMMs' accumulation order
and h's bias (rounded into h here, added in fp32 by the fused kernel).

Unlike `fused` (which recomputes a from h), a is kept for dw2 as TE's GroupedLinear keeps its input:
T x (H + F) saved instead of T x H. Bias grads and fc2 bias's dprobs share are torch (expert_math), as in
`fused`.

The expert row counts are read on the host (`m_splits`, a device sync on CUDA, as in TE's GroupedLinear),
so this backend cannot run inside a CUDA graph (MOE059).

Under gradient-accumulation fusion (`wgrad_into`), the wgrad GEMMs add fp32 products straight into the
fp32 main_grad matrices (TE's `accumulate=True`), as TE does for Megatron's `main_grad`. Delayed wgrad
(`backward_dgrad`): both data grads now, the two wgrad GEMMs and the bias grads when `wgrad()` runs;
`backward` is that split called at once, so the two agree bitwise.

Low precision (`precision=ExpertPrecision`): moectl's fp8 `tensorwise` recipe only, run as TE's
Float8CurrentScaling quantizers (te_gemm.Fp8Operands); weight grads come back fp32. Other recipes, fp4 and
fp8 param gather are refused before the run (MOE062) and here. Every expert segment must be a multiple of
the recipe's alignment (the dispatcher pads).

Import: TE is imported when the backend is built (te_runtime.load_te), never at package import, and only
on CUDA (TE's kernels are CUDA only; MOE040 refuses `te` on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from moectl.core.errors import MoectlError
from moectl.core.facts import ffn_width
from trainer.moe import expert_math
from trainer.moe.backends import te_activation as act
from trainer.moe.backends import te_gemm as gemm
from trainer.moe.backends.te_runtime import TE, load_te

WgradTargets = tuple[list[torch.Tensor], list[torch.Tensor]]  # fc1's and fc2's per-expert fp32 grad targets
OptTensor = Optional[torch.Tensor]


def host_splits(tokens_per_expert_E: Any, rows: int) -> list[int]:
    """The per-expert row counts as Python ints (TE's `m_splits`), checked to cover the rows of x."""
    splits = [int(c) for c in torch.as_tensor(tokens_per_expert_E).tolist()]
    if any(c < 0 for c in splits) or sum(splits) != rows:
        raise ValueError(f"tokens_per_expert {splits} must be non-negative and sum to the rows of x ({rows})")
    return splits


@dataclass
class TECtx:
    """What backward needs. Operand lists are per expert: views (bf16/fp32) or TE fp8 storages (columnwise)."""

    x_TD: torch.Tensor
    h_TH: torch.Tensor
    x_ops: list[Any]  # fc1's input per expert (fp8: its columnwise copy)
    a_ops: list[Any]  # fc2's input per expert
    w1_ops: list[Any]
    w2_ops: list[Any]
    w_shapes: tuple[torch.Size, torch.Size]
    b1_EH: OptTensor
    b2_ED: OptTensor
    probs_T: OptTensor
    scales_T: OptTensor
    m_splits: list[int]
    counts_E: torch.Tensor
    expert_T: OptTensor
    activation: str
    interleave: Optional[int]
    fp8: Optional[gemm.Fp8Operands]


class TEBackend:
    """Expert-MLP backend `te` (module docstring). Built by the registry as `TEBackend(device)`; `te` hands it
    TE's entry points directly (tests on machines without TE pass a stand-in)."""

    name = "te"

    def __init__(self, device: torch.device | str | None = None, te: Optional[TE] = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cuda")
        if te is None:
            if self.device.type != "cuda":
                raise MoectlError(
                    f"expert backend 'te' runs Transformer Engine's CUDA kernels, not on {self.device.type} (MOE040)",
                    "set moe.backend: auto (it picks the reference path on the CPU)",
                )
            te = load_te()
        self.te = te

    # ---- forward -----------------------------------------------------------------------------------
    def forward(
        self,
        x_TD: torch.Tensor,
        w1_EHD: torch.Tensor,
        b1_EH: OptTensor,
        w2_EDF: torch.Tensor,
        b2_ED: OptTensor,
        tokens_per_expert_E: torch.Tensor,
        probs_T: OptTensor,
        spec: Any,
        precision: Any = None,
    ) -> tuple[torch.Tensor, TECtx]:
        """y_TD = probs * (fc2(act(fc1(x) + b1)) + b2), and the context for `backward`.

        `precision`: an `ExpertPrecision` with moectl's fp8 tensorwise recipe runs every GEMM in TE's fp8.
        """
        activation = str(spec.activation)
        interleave = int(spec.glu_interleave_size) if getattr(spec, "glu_interleave_size", None) else None
        num_experts, h_width, d_model = w1_EHD.shape
        f = ffn_width(h_width, activation, interleave)
        if w2_EDF.shape != (num_experts, d_model, f):
            raise ValueError(f"w2_EDF has shape {tuple(w2_EDF.shape)}, expected {(num_experts, d_model, f)}")
        rows, dtype, device = x_TD.shape[0], x_TD.dtype, x_TD.device
        m_splits = host_splits(tokens_per_expert_E, rows)
        if len(m_splits) != num_experts:
            raise ValueError(f"{len(m_splits)} token counts for {num_experts} experts")
        fp8 = None if precision is None else self._fp8_operands(precision, m_splits, device)
        need_grad = precision.need_grad if precision is not None else True
        x = x_TD.contiguous()
        w1, w2 = w1_EHD.to(dtype).contiguous(), w2_EDF.to(dtype).contiguous()
        counts_E = torch.tensor(m_splits, dtype=torch.int64, device=device)
        expert_T = expert_math.expert_of_row(counts_E, rows) if b2_ED is not None else None
        ctx = TECtx(
            x, x.new_empty(0, h_width), [], [], [], [], (w1_EHD.shape, w2_EDF.shape), b1_EH, b2_ED, probs_T, None,
            m_splits, counts_E, expert_T, activation, interleave, fp8,
        )  # fmt: skip
        if rows == 0:  # nothing routed here: no kernel call (TE's kernels want at least one row)
            return x.new_empty(0, d_model), ctx
        scales_T = probs_T.contiguous() if probs_T is not None else torch.ones(rows, dtype=torch.float32, device=device)
        if fp8 is None:
            x_ops, w1_ops, w2_ops = gemm.split_rows(x, m_splits), list(w1.unbind(0)), list(w2.unbind(0))
        else:
            x_ops = fp8.activation(x, m_splits, columnwise=need_grad)
            w1_ops, w2_ops = fp8.weight(w1, columnwise=need_grad), fp8.weight(w2, columnwise=need_grad)
        h_TH = gemm.fprop(self.te, w1_ops, x_ops, m_splits, h_width, dtype, device, _bias_list(b1_EH, dtype, fp8))
        a_TF = act.act_forward(self.te.tex, h_TH, scales_T, activation, interleave)
        a_ops = gemm.split_rows(a_TF, m_splits) if fp8 is None else fp8.activation(a_TF, m_splits, need_grad)
        y_TD = gemm.fprop(self.te, w2_ops, a_ops, m_splits, d_model, dtype, device)
        if b2_ED is not None:
            assert expert_T is not None
            y_TD = expert_math.add_row_bias(y_TD, probs_T, b2_ED.to(dtype), expert_T)
        if fp8 is not None and need_grad:  # wgrad reads only the columnwise copies of x and a
            fp8.keep_columnwise(x_ops)
            fp8.keep_columnwise(a_ops)
        ctx.h_TH, ctx.x_ops, ctx.a_ops, ctx.scales_T = h_TH, x_ops, a_ops, scales_T
        ctx.w1_ops, ctx.w2_ops = w1_ops, w2_ops
        return y_TD, ctx

    def _fp8_operands(self, precision: Any, m_splits: list[int], device: torch.device) -> gemm.Fp8Operands:
        """TE quantizers for `precision`'s recipe; refuses what this backend cannot run (MOE062 says it first)."""
        from trainer.precision.recipes import TensorwiseRecipe

        recipe = precision.recipe
        if type(recipe) is not TensorwiseRecipe:
            raise MoectlError(
                f"expert backend 'te' runs fp8 only as the tensorwise recipe (TE's Float8CurrentScaling), not "
                f"{recipe.name} (MOE062)",
                "set mixed_precision.fp8_recipe: tensorwise, or moe.backend: fused",
            )
        if any(q is not None for q in precision.quantized_weights.values()):
            raise MoectlError(
                "expert backend 'te' quantizes the weights itself and cannot read fp8 param gather's weights (MOE062)",
                "set mixed_precision.fp8_param_gather: false, or moe.backend: fused",
            )
        align = recipe.align_size
        if any(m % align for m in m_splits):
            raise ValueError(
                f"recipe {recipe.name} needs every expert's row count to be a multiple of {align}; got {m_splits}. "
                "Pad expert segments in dispatch (MoELayer(align=recipe.align_size))"
            )
        return gemm.Fp8Operands(self.te, recipe, device)

    # ---- backward ----------------------------------------------------------------------------------
    def backward(self, ctx: TECtx, dy_TD: torch.Tensor, wgrad_into: Optional[WgradTargets] = None) -> tuple[OptTensor, ...]:
        """(dx, dw1, db1, dw2, db2, dprobs); None for the inputs that were None.

        `wgrad_into` (gradient-accumulation fusion, high precision): per-expert fp32 `[H, D]` and `[D, F]`
        targets the weight grads are added into by the wgrad GEMMs; dw1 and dw2 then come back None."""
        dx_TD, dprobs_T, wgrad = self.backward_dgrad(ctx, dy_TD, wgrad_into)
        dw1_EHD, db1_EH, dw2_EDF, db2_ED = wgrad()
        return dx_TD, dw1_EHD, db1_EH, dw2_EDF, db2_ED, dprobs_T

    def backward_dgrad(self, ctx: TECtx, dy_TD: torch.Tensor, wgrad_into: Optional[WgradTargets] = None
                       ) -> tuple[torch.Tensor, OptTensor, Callable[[], tuple[OptTensor, ...]]]:  # fmt: skip
        """(dx, dprobs, wgrad): the data grads now, the weight and bias grads when `wgrad()` is called."""
        if ctx.fp8 is not None and wgrad_into is not None:
            raise ValueError("wgrad_into is for the high-precision path; a recipe's wgrad is fp32 already")
        x, h, probs = ctx.x_TD, ctx.h_TH, ctx.probs_T
        rows, dtype, device = x.shape[0], x.dtype, x.device
        (_, h_width, d_model), (_, _, f) = ctx.w_shapes
        if rows == 0:
            return _empty_grads(ctx, wgrad_into)
        fp8, m = ctx.fp8, ctx.m_splits
        split_acc = gemm.SPLIT_ACC_BACKWARD if fp8 is None else fp8.split_accumulator
        dy = dy_TD.to(dtype).contiguous()  # TE reads pointers: no stride-0 (expanded) grads
        dy_ops = gemm.split_rows(dy, m) if fp8 is None else fp8.grad(dy, m)
        da_TF = gemm.dgrad(self.te, ctx.w2_ops, dy_ops, m, f, dtype, device, split_acc)
        dh_TH, dprobs_T = act.act_backward(
            self.te.tex, da_TF, h, ctx.scales_T, ctx.activation, ctx.interleave, scale_grad=probs is not None
        )  # fmt: skip
        if dprobs_T is not None and probs is not None:
            dprobs_T = dprobs_T.to(probs.dtype)
        dh_ops = gemm.split_rows(dh_TH, m) if fp8 is None else fp8.grad(dh_TH, m)
        dx_TD = gemm.dgrad(self.te, ctx.w1_ops, dh_ops, m, d_model, dtype, device, split_acc)
        dprobs_T = expert_math.dprobs_with_b2(ctx.b2_ED, probs, ctx.expert_T, dy, dprobs_T)
        te = self.te

        def wgrad() -> tuple[OptTensor, OptTensor, OptTensor, OptTensor]:
            dw1_EHD = dw2_EDF = None
            if wgrad_into is not None:
                w1_into, w2_into = wgrad_into
                gemm.wgrad(te, ctx.a_ops, dy_ops, list(w2_into), m, accumulate=True, split_accumulator=split_acc)
                gemm.wgrad(te, ctx.x_ops, dh_ops, list(w1_into), m, accumulate=True, split_accumulator=split_acc)
            else:
                w_dtype = torch.float32 if fp8 is not None else dtype  # a recipe's weight grads are fp32
                dw2_EDF = torch.empty(ctx.w_shapes[1], dtype=w_dtype, device=device)
                dw1_EHD = torch.empty(ctx.w_shapes[0], dtype=w_dtype, device=device)
                gemm.wgrad(te, ctx.a_ops, dy_ops, list(dw2_EDF.unbind(0)), m, False, split_acc)
                gemm.wgrad(te, ctx.x_ops, dh_ops, list(dw1_EHD.unbind(0)), m, False, split_acc)
            db1_EH, db2_ED = expert_math.bias_grads_scaled(ctx.b1_EH, ctx.b2_ED, probs, ctx.counts_E, dy, dh_TH)
            return dw1_EHD, db1_EH, dw2_EDF, db2_ED

        return dx_TD, dprobs_T, wgrad


def _bias_list(b_EO: OptTensor, dtype: torch.dtype, fp8: Any) -> Optional[list[torch.Tensor]]:
    """A bias as TE's per-expert list, in the GEMM's output dtype (bf16 for an fp8 GEMM with fp32 output:
    TE's fp8 GEMMs take bf16/fp16 biases only)."""
    if b_EO is None:
        return None
    bias_dtype = torch.bfloat16 if fp8 is not None and dtype == torch.float32 else dtype
    return list(b_EO.to(bias_dtype).contiguous().unbind(0))


def _empty_grads(ctx: TECtx, wgrad_into: Optional[WgradTargets]) -> tuple[torch.Tensor, OptTensor, Callable[[], Any]]:
    """No row routed here: dx and dprobs empty, zero weight and bias grads (none added under `wgrad_into`)."""
    x = ctx.x_TD
    w_dtype = torch.float32 if ctx.fp8 is not None else x.dtype

    def zeros(t: OptTensor) -> OptTensor:
        return None if t is None else torch.zeros_like(t)

    def wgrad() -> tuple[OptTensor, OptTensor, OptTensor, OptTensor]:
        if wgrad_into is not None:
            return None, zeros(ctx.b1_EH), None, zeros(ctx.b2_ED)
        w1 = torch.zeros(ctx.w_shapes[0], dtype=w_dtype, device=x.device)
        w2 = torch.zeros(ctx.w_shapes[1], dtype=w_dtype, device=x.device)
        return w1, zeros(ctx.b1_EH), w2, zeros(ctx.b2_ED)

    return torch.zeros_like(x), zeros(ctx.probs_T), wgrad
