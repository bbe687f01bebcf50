"""The `fused` expert-MLP backend: grouped GEMM -> fused activation (with routing probs) -> grouped GEMM.

Legend: T routed rows (tokens after permute, grouped by expert), D model width, H fc1 width (2F gated),
F expert ffn width, E experts. Weights are `[E, out, in]`: w1_EHD, w2_EDF; biases b1_EH, b2_ED.

Computes, per the expert-backend protocol (`__init__.py`),

    y = probs[:, None] * (fc2(act(fc1(x) + b1)) + b2)

as
    h_TH  = grouped_mm(x, w1^T)                       (saved for backward; no bias in it)
    a_TF  = probs * act(h + b1[expert])               (one kernel; expert_math.py says why probs go here)
    y_TD  = grouped_mm(a, w2^T) [+ probs * b2[expert]] (bias epilogue only when there is a b2)

and backward by recomputation: only h (T x H) is kept between forward and backward, never the F-wide
activation. Backward: da = grouped_mm(dy, w2); one kernel reads h, probs, da and writes dh, the recomputed a
and dprobs; then dw2 = grouped_mm(dy^T, a), dx = grouped_mm(dh, w1), dw1 = grouped_mm(dh^T, x)
(2-D x 2-D -> 3-D, one group per expert, contracting over that expert's rows). On CUDA the two weight-grad
GEMMs run on a second stream, concurrently with dx (`FusedBackend.overlap_wgrad`).

On CUDA the activation runs in Triton (`trainer/kernels/glu_triton.py`); elsewhere in its pure-torch
reference (`expert_math.fused_forward` / `fused_backward`), through the same code path, so this backend is
tested on every machine.

Low precision (`forward(..., precision=ExpertPrecision)`, trainer/moe/expert_precision.py): the two grouped
GEMMs become the recipe's quantized grouped GEMMs (fprop, dgrad, wgrad; native `torch._scaled_grouped_mm`
or exact emulation) around the same fused activation kernel. fc2's input a = probs * act(h + b1) is
quantized in forward and its columnwise copy kept for dw2 (recomputing it in backward would quantize it
twice, and record delayed scaling's amax twice), so under a recipe backward does not recompute a. The
probs sit inside fc2's quantized input here (outside it in the loop/grouped backends), so fused and grouped
agree within the recipe's rounding, not bitwise. With `wgrad_into` the weight grads are added into the fp32
targets: by the fp8 kernel that sums in fp32 and adds in its epilogue where it applies (per-tensor e4m3 or
hybrid on Hopper, `native.grouped_wgrad_accumulate_`), else the recipe's product then one add.

Constraints inherited from `torch._grouped_mm`: every row stride 16-byte aligned (D, H, F multiples of 8 in
bf16) and no stride-0 operands (a broadcast dy is made contiguous). Rows of x beyond
sum(tokens_per_expert) are not computed by the GEMMs: the caller passes sum(tokens_per_expert) == T
(checked where it costs no device sync, i.e. on CPU).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from moectl.core.errors import MoectlError
from moectl.core.facts import ffn_width
from trainer.kernels.grouped_wgrad import accumulate_grouped_wgrad_
from trainer.kernels.stale_zero import settle_stale_
from trainer.moe import expert_math
from trainer.moe.expert_math import bias_grads, expert_of_row
from trainer.moe.expert_precision import qlinear_forward, quantize_output_grad
from trainer.moe.wgrad_deferral import WgradStash
from trainer.precision.groups import TokenGroups
from trainer.precision.native import grouped_wgrad_accumulate_
from trainer.precision.quantize import triton_fast_path
from trainer.precision.recipes import TensorwiseRecipe
from trainer.regions import GRAD_ACCUMULATE, region
from trainer.streams import side_stream
from trainer.switches import switched_off

WgradTargets = tuple[list[torch.Tensor], list[torch.Tensor]]  # fc1's and fc2's per-expert fp32 grad targets
Grads = tuple[
    torch.Tensor,
    torch.Tensor,
    "torch.Tensor | None",
    torch.Tensor,
    "torch.Tensor | None",
    "torch.Tensor | None",
]


def spec_activation(spec: Any) -> str:
    """The activation named by an expert spec (`ExpertSpec` of trainer.moe.expert_math, or any object)."""
    return str(getattr(spec, "activation"))


def spec_interleave(spec: Any) -> int | None:
    """The fc1 gate/up interleave block of an expert spec (None: `[gate; up]`)."""
    value = getattr(spec, "glu_interleave_size", None)
    return int(value) if value else None


class _Reference:
    """The activation kernels' pure-torch reference, with the Triton module's entry points (CPU path)."""

    glu_forward = staticmethod(expert_math.fused_forward)
    glu_backward = staticmethod(expert_math.fused_backward)


def _kernels(device: torch.device) -> Any:
    """Triton kernels on CUDA, the pure-torch reference elsewhere (Triton is imported only here, lazily)."""
    if device.type == "cuda":
        from trainer.kernels import glu_triton

        return glu_triton
    return _Reference


@contextlib.contextmanager
def _on_side(side: "torch.cuda.Stream | None") -> Iterator[None]:
    """Run the block on `side` after the work queued so far on the current stream (None: on the current stream)."""
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream(side.device))
    with torch.cuda.stream(side):
        yield


def _join(side: "torch.cuda.Stream | None", *made_on_side: torch.Tensor) -> None:
    """Make the current stream wait for `side`, and tell the caching allocator that tensors allocated there are
    used on the current stream from here on. Tensors the current stream made and `side` read are released
    after this wait, so their memory cannot go to work that runs before `side` has read them."""
    if side is None:
        return
    main = torch.cuda.current_stream(side.device)
    main.wait_stream(side)
    for t in made_on_side:
        t.record_stream(main)


def _offsets(tokens_per_expert_E: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Cumulative row ends per expert on the compute device: int32 (what grouped_mm takes), or int64 (what
    TokenGroups keeps; it makes its int32 copy once)."""
    counts = torch.as_tensor(tokens_per_expert_E)
    return torch.cumsum(counts.to(device=device, dtype=torch.int64), 0).to(dtype)


@dataclass
class FusedCtx:
    """What backward needs: inputs, the fc1 output h (without bias), offsets, row experts, the spec."""

    x_TD: torch.Tensor
    h_TH: torch.Tensor
    w1_EHD: torch.Tensor
    b1_EH: torch.Tensor | None
    w2_EDF: torch.Tensor
    b2_ED: torch.Tensor | None
    probs_T: torch.Tensor | None
    offs_E: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    expert_T: torch.Tensor | None
    activation: str
    interleave: int | None


class FusedBackend:
    """Expert-MLP backend `fused`: two grouped GEMMs around one fused activation kernel, recompute backward.

    `recipe_wgrad_into`: it accumulates weight grads into `wgrad_into` under a recipe too (`_quantized_wgrad`).

    Built by the registry (`trainer.moe.backends.get_backend`) as `FusedBackend(device)`.

    `overlap_wgrad` (CUDA only): run the two weight-grad GEMMs on a second stream, concurrently with fc1's
    data-grad GEMM; the three are independent once the activation backward has run, and running them side
    by side fills the tail waves of each (measured on an H200 at the benchmark's shapes: fc1 dgrad+wgrad
    1-3% faster). Default from `MOECTL_FUSED_OVERLAP_WGRAD` (1 = on, the default; 0 = one stream), so a
    benchmark can compare both without code changes. Results are bitwise the same either way.
    """

    name = "fused"
    recipe_wgrad_into = True

    def __init__(self, device: torch.device | str | None = None, overlap_wgrad: bool | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        if overlap_wgrad is None:
            overlap_wgrad = not switched_off("MOECTL_FUSED_OVERLAP_WGRAD")
        self.overlap_wgrad = overlap_wgrad

    @staticmethod
    def forward(
        x_TD: torch.Tensor,
        w1_EHD: torch.Tensor,
        b1_EH: torch.Tensor | None,
        w2_EDF: torch.Tensor,
        b2_ED: torch.Tensor | None,
        tokens_per_expert_E: torch.Tensor,
        probs_T: torch.Tensor | None,
        spec: Any,
        precision: Any = None,
    ) -> tuple[torch.Tensor, Any]:
        """y_TD = probs * (fc2(act(fc1(x) + b1)) + b2), and the context for `backward`.

        `precision`: an `ExpertPrecision` (trainer.moe.expert_precision) runs both GEMMs in its recipe.
        """
        if precision is not None:
            return _forward_quantized(x_TD, w1_EHD, b1_EH, w2_EDF, b2_ED, tokens_per_expert_E, probs_T, spec, precision)
        activation, interleave = spec_activation(spec), spec_interleave(spec)
        num_experts, h_width, d_model = w1_EHD.shape
        f = ffn_width(h_width, activation, interleave)
        if w2_EDF.shape != (num_experts, d_model, f):
            raise ValueError(f"w2_EDF has shape {tuple(w2_EDF.shape)}, expected {(num_experts, d_model, f)}")
        _check_alignment(x_TD.dtype, d_model, h_width, f)
        rows = x_TD.shape[0]
        counts_E = torch.as_tensor(tokens_per_expert_E).to(x_TD.device)
        offs_E = _offsets(counts_E, x_TD.device)
        if x_TD.device.type == "cpu" and rows and int(offs_E[-1]) != rows:
            raise ValueError(f"sum(tokens_per_expert)={int(offs_E[-1])} must equal the rows of x ({rows})")
        w1, w2 = w1_EHD.to(x_TD.dtype), w2_EDF.to(x_TD.dtype)
        need_rows = b1_EH is not None or b2_ED is not None
        expert_T = expert_of_row(counts_E, rows) if need_rows else None
        kernels = _kernels(x_TD.device)
        if rows:
            h_TH = torch._grouped_mm(x_TD, w1.transpose(-2, -1), offs_E)
            a_TF = kernels.glu_forward(h_TH, probs_T, activation, interleave, b1_EH, expert_T)
            y_TD = torch._grouped_mm(a_TF, w2.transpose(-2, -1), offs_E)
            if b2_ED is not None:
                assert expert_T is not None
                y_TD = _add_row_bias(kernels, y_TD, probs_T, b2_ED.to(y_TD.dtype), expert_T)
        else:  # grouped_mm rejects an empty contraction in backward; keep both directions trivially right
            h_TH = x_TD.new_empty(0, h_width)
            y_TD = x_TD.new_empty(0, d_model)
        ctx = FusedCtx(x_TD, h_TH, w1, b1_EH, w2, b2_ED, probs_T, offs_E, counts_E, expert_T, activation, interleave)
        return y_TD, ctx

    def backward(self, ctx: Any, dy_TD: torch.Tensor, wgrad_into: WgradTargets | None = None,
                 wgrad_stale: WgradTargets | None = None, wgrad_sq: list[torch.Tensor] | None = None,
                 wgrad_stash: WgradStash | None = None, wgrad_defer: bool = False) -> Grads:
        """(dx, dw1, db1, dw2, db2, dprobs); None for the inputs that were None.

        `wgrad_into` (gradient-accumulation fusion, high precision): per-expert fp32 `[H, D]` and `[D, F]`
        targets that the weight grads are added into as fp32 products (`trainer/kernels/grouped_wgrad.py`);
        dw1 and dw2 then come back None. `wgrad_stale`: the targets' stale flags (high precision only): flagged
        targets are overwritten and their flags cleared (trainer/main_grad.py). `wgrad_sq` (a list, with
        `wgrad_into`, high precision): the partial sums of squares of the w1 and w2 targets after the add are
        appended to it, in that order (trainer/grad_sq.py); nothing is appended when no kernel ran.
        `wgrad_stash` (with `wgrad_into`, high precision; trainer/moe/wgrad_deferral.py): `wgrad_defer` keeps this
        micro-batch's wgrad operands there instead of adding its products; else the stashed micro-batches'
        products are added with this one's, in one pass over the targets.
        """
        if isinstance(ctx, QuantizedFusedCtx):
            if wgrad_stale is not None:
                raise ValueError("wgrad_stale is a high-precision keyword: settle the targets before a recipe backward")
            return _backward_quantized(ctx, dy_TD, self.overlap_wgrad, wgrad_into)
        x, h, w1, w2, probs = ctx.x_TD, ctx.h_TH, ctx.w1_EHD, ctx.w2_EDF, ctx.probs_T
        rows = x.shape[0]
        # grouped_mm rejects stride-0 (expanded) grads and needs aligned rows: make dy a plain tensor.
        dy = dy_TD.to(x.dtype).contiguous()
        if rows == 0:
            if wgrad_stash is not None and not wgrad_defer and wgrad_stash.entries:
                assert wgrad_into is not None  # the earlier micro-batches' products still go in
                wgrad_sq_out = _add_wgrads(wgrad_into, wgrad_stale, wgrad_stash.take(), wgrad_sq is not None)
                if wgrad_sq is not None and wgrad_sq_out is not None:
                    wgrad_sq += wgrad_sq_out
                wgrad_stale = None  # the add above settled them
            return _empty_grads(ctx, wgrad_into, wgrad_stale)
        kernels = _kernels(x.device)
        da_TF = torch._grouped_mm(dy, w2, ctx.offs_E)
        dh_TH, dprobs_T, a_TF = kernels.glu_backward(
            h, probs, da_TF, ctx.activation, ctx.interleave, ctx.b1_EH, ctx.expert_T
        )
        # Weight grads come out contiguous in [E, out, in]: the transposed operand order (x^T dh)^T is up to
        # 5% faster for some shapes, but hands back a transposed grad that costs a full copy downstream.
        side = side_stream(x.device, "wgrad") if self.overlap_wgrad and x.is_cuda else None
        dw1_EHD = dw2_EDF = None
        with _on_side(side):
            if wgrad_into is None:
                dw2_EDF = torch._grouped_mm(dy.t(), a_TF, ctx.offs_E)
                dw1_EHD = torch._grouped_mm(dh_TH.t(), x, ctx.offs_E)
            elif wgrad_stash is not None and wgrad_defer:  # the last micro-batch adds these products
                wgrad_stash.defer(((dy, a_TF, ctx.tokens_per_expert_E, ctx.offs_E),
                                   (dh_TH, x, ctx.tokens_per_expert_E, ctx.offs_E)))
            else:
                earlier = wgrad_stash.take() if wgrad_stash is not None else []
                now = ((dy, a_TF, ctx.tokens_per_expert_E, ctx.offs_E), (dh_TH, x, ctx.tokens_per_expert_E, ctx.offs_E))
                out = _add_wgrads(wgrad_into, wgrad_stale, [*earlier, now], wgrad_sq is not None)
                if wgrad_sq is not None and out is not None:
                    wgrad_sq += out
        dx_TD = torch._grouped_mm(dh_TH, w1, ctx.offs_E)
        _join(side, *(t for t in (dw2_EDF, dw1_EHD, *(wgrad_sq or ())) if t is not None))
        db1_EH, db2_ED, dprobs_T = _bias_grads(
            ctx.b1_EH, ctx.b2_ED, probs, ctx.expert_T, ctx.tokens_per_expert_E, dy, dh_TH, dprobs_T
        )
        return dx_TD, dw1_EHD, db1_EH, dw2_EDF, db2_ED, dprobs_T

    def backward_dgrad(self, ctx: Any, dy_TD: torch.Tensor, wgrad_into: WgradTargets | None = None,
                       wgrad_stale: WgradTargets | None = None) -> tuple[torch.Tensor, "torch.Tensor | None", Any]:
        """(dx, dprobs, wgrad): `backward`'s kernels, the two weight-grad GEMMs and the bias grads deferred to
        `wgrad()` (delayed wgrad: they then run on the current stream, when the caller calls it). With
        `wgrad_into` (and `wgrad_stale`), `wgrad()` accumulates the weight grads there (as `backward` does) and
        returns None for them."""
        if isinstance(ctx, QuantizedFusedCtx):
            if wgrad_stale is not None:
                raise ValueError("wgrad_stale is a high-precision keyword: settle the targets before a recipe backward")
            return _backward_quantized_dgrad(ctx, dy_TD, wgrad_into)
        x, h, w1, w2, probs = ctx.x_TD, ctx.h_TH, ctx.w1_EHD, ctx.w2_EDF, ctx.probs_T
        dy = dy_TD.to(x.dtype).contiguous()
        if x.shape[0] == 0:
            dx, dw1, db1, dw2, db2, dprobs = _empty_grads(ctx, wgrad_into, wgrad_stale)
            return dx, dprobs, lambda: (dw1, db1, dw2, db2)
        kernels = _kernels(x.device)
        da_TF = torch._grouped_mm(dy, w2, ctx.offs_E)
        dh_TH, dprobs_T, a_TF = kernels.glu_backward(
            h, probs, da_TF, ctx.activation, ctx.interleave, ctx.b1_EH, ctx.expert_T
        )
        dx_TD = torch._grouped_mm(dh_TH, w1, ctx.offs_E)
        dprobs_T = _dprobs_with_b2(ctx.b2_ED, probs, ctx.expert_T, dy, dprobs_T)

        def wgrad() -> tuple["torch.Tensor | None", "torch.Tensor | None", "torch.Tensor | None", "torch.Tensor | None"]:
            dw1_EHD = dw2_EDF = None
            if wgrad_into is None:
                dw2_EDF = torch._grouped_mm(dy.t(), a_TF, ctx.offs_E)
                dw1_EHD = torch._grouped_mm(dh_TH.t(), x, ctx.offs_E)
            else:
                w1_stale, w2_stale = wgrad_stale or (None, None)
                accumulate_grouped_wgrad_(wgrad_into[1], dy, a_TF, ctx.tokens_per_expert_E, ctx.offs_E, w2_stale)
                accumulate_grouped_wgrad_(wgrad_into[0], dh_TH, x, ctx.tokens_per_expert_E, ctx.offs_E, w1_stale)
            db1_EH, db2_ED = _bias_only(ctx.b1_EH, ctx.b2_ED, probs, ctx.tokens_per_expert_E, dy, dh_TH)
            return dw1_EHD, db1_EH, dw2_EDF, db2_ED

        return dx_TD, dprobs_T, wgrad


def _add_wgrads(wgrad_into: WgradTargets, wgrad_stale: WgradTargets | None, micro_batches: list[Any],
                sq: bool) -> list[torch.Tensor] | None:
    """Add the w2 and w1 products of `micro_batches` (each `((dy, a, counts, offs), (dh, x, counts, offs))`,
    oldest first) into the targets, fc2's first; their partial sums of squares (w1's, w2's) when `sq`."""
    (w1_into, w2_into), (w1_stale, w2_stale) = wgrad_into, wgrad_stale or (None, None)
    *w2_earlier, w2_now = [m[0] for m in micro_batches]
    *w1_earlier, w1_now = [m[1] for m in micro_batches]
    sq2 = accumulate_grouped_wgrad_(w2_into, *w2_now, w2_stale, sq, earlier=w2_earlier)
    sq1 = accumulate_grouped_wgrad_(w1_into, *w1_now, w1_stale, sq, earlier=w1_earlier)
    return [sq1, sq2] if sq1 is not None and sq2 is not None else None


_bias_only = expert_math.bias_grads_scaled  # (db1, db2): the math is expert_math's, shared with the te backend
_dprobs_with_b2 = expert_math.dprobs_with_b2


def _bias_grads(
    b1_EH: torch.Tensor | None,
    b2_ED: torch.Tensor | None,
    probs_T: torch.Tensor | None,
    expert_T: torch.Tensor | None,
    tokens_per_expert_E: torch.Tensor,
    dy_TD: torch.Tensor,
    dh_TH: torch.Tensor,
    dprobs_T: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(db1, db2, dprobs): per-expert bias grads, and p * b2's share of dprobs (the two halves above)."""
    db1_EH, db2_ED = _bias_only(b1_EH, b2_ED, probs_T, tokens_per_expert_E, dy_TD, dh_TH)
    return db1_EH, db2_ED, _dprobs_with_b2(b2_ED, probs_T, expert_T, dy_TD, dprobs_T)


@dataclass
class QuantizedFusedCtx:
    """Backward's needs under a recipe: h, the quantized fc1/fc2 operands (None without grad), shapes."""

    h_TH: torch.Tensor
    fc1: Any  # trainer.moe.expert_precision.SavedLinear
    fc2: Any
    x_TD: torch.Tensor  # kept only when empty (the grads' shapes); else None
    w_shapes: tuple[torch.Size, torch.Size]
    b1_EH: torch.Tensor | None
    b2_ED: torch.Tensor | None
    probs_T: torch.Tensor | None
    tokens_per_expert_E: torch.Tensor
    expert_T: torch.Tensor | None
    activation: str
    interleave: int | None


def _forward_quantized(
    x_TD: torch.Tensor,
    w1_EHD: torch.Tensor,
    b1_EH: torch.Tensor | None,
    w2_EDF: torch.Tensor,
    b2_ED: torch.Tensor | None,
    tokens_per_expert_E: torch.Tensor,
    probs_T: torch.Tensor | None,
    spec: Any,
    precision: Any,
) -> tuple[torch.Tensor, QuantizedFusedCtx]:
    """The recipe path of `FusedBackend.forward` (module docstring): quantized grouped GEMMs, fused activation."""
    activation, interleave = spec_activation(spec), spec_interleave(spec)
    num_experts, h_width, d_model = w1_EHD.shape
    f = ffn_width(h_width, activation, interleave)
    if w2_EDF.shape != (num_experts, d_model, f):
        raise ValueError(f"w2_EDF has shape {tuple(w2_EDF.shape)}, expected {(num_experts, d_model, f)}")
    counts_E = torch.as_tensor(tokens_per_expert_E)
    precision.check_aligned(counts_E)
    counts_E = counts_E.to(x_TD.device)
    rows = x_TD.shape[0]
    offs_E = _offsets(counts_E, x_TD.device, torch.int64)  # no int32 round trip through TokenGroups
    groups = TokenGroups.from_offsets(offs_E, rows, validate=x_TD.device.type == "cpu", uniform=precision.uniform_rows)
    expert_T = expert_of_row(counts_E, rows) if b1_EH is not None or b2_ED is not None else None
    kernels = _kernels(x_TD.device)
    x_TD = x_TD.contiguous()
    amax_x, amax_a = _amax_slots(kernels, precision, x_TD, groups)
    h_TH, fc1 = qlinear_forward(precision, "fc1", x_TD, w1_EHD, groups, amax=_as_amax(amax_x))
    a_TF = (
        kernels.glu_forward(h_TH, probs_T, activation, interleave, b1_EH, expert_T, **_amax_kw(amax_a, groups))
        if rows else h_TH[:, :f]
    )  # fmt: skip
    y_TD, fc2 = qlinear_forward(precision, "fc2", a_TF, w2_EDF, groups, amax=_as_amax(amax_a))
    if b2_ED is not None and rows:
        assert expert_T is not None
        y_TD = _add_row_bias(kernels, y_TD, probs_T, b2_ED.to(y_TD.dtype), expert_T)
    ctx = QuantizedFusedCtx(
        h_TH, fc1, fc2, x_TD if rows == 0 else None, (w1_EHD.shape, w2_EDF.shape), b1_EH, b2_ED, probs_T, counts_E,
        expert_T, activation, interleave,
    )  # fmt: skip
    return y_TD, ctx


def _backward_quantized(
    ctx: QuantizedFusedCtx, dy_TD: torch.Tensor, overlap_wgrad: bool = False, into: WgradTargets | None = None
) -> Grads:
    """The recipe path of `FusedBackend.backward`: fc2 dgrad/wgrad, fused activation backward, fc1.

    With `overlap_wgrad` on CUDA both weight-grad GEMMs run on the side stream: dw2 while the main stream
    does the activation backward, the quantization of dh and dx (memory-bound kernels beside a
    compute-bound GEMM), dw1 beside dx. The same kernels on the same operands, so the same bits."""
    if ctx.fc1 is None or ctx.fc2 is None:
        raise RuntimeError("expert backward after a forward without grad")
    h, probs, fc1, fc2 = ctx.h_TH, ctx.probs_T, ctx.fc1, ctx.fc2
    if h.shape[0] == 0:
        assert ctx.x_TD is not None
        zeros = lambda t: None if t is None else torch.zeros_like(t)  # noqa: E731
        w1 = None if into else torch.zeros(ctx.w_shapes[0], dtype=torch.float32, device=h.device)
        w2 = None if into else torch.zeros(ctx.w_shapes[1], dtype=torch.float32, device=h.device)
        return torch.zeros_like(ctx.x_TD), w1, zeros(ctx.b1_EH), w2, zeros(ctx.b2_ED), zeros(probs)
    dy = dy_TD.to(h.dtype).contiguous()
    side = side_stream(h.device, "wgrad") if overlap_wgrad and h.is_cuda else None
    kernels = _kernels(h.device)
    amax_dy, amax_dh = _amax_slots(kernels, fc2, dy, fc2.groups)
    g2 = quantize_output_grad(fc2, dy, _as_amax(amax_dy))
    da_TF = fc2.recipe.grouped_dgrad(g2, fc2.wq, fc2.x_dtype)
    with _on_side(side):
        dw2_EDF = _quantized_wgrad(fc2, g2, None if into is None else into[1])
    extra = {} if kernels is _Reference else {"write_a": False}  # a's quantized copy was kept instead
    dh_TH, dprobs_T, _ = kernels.glu_backward(
        h, probs, da_TF, ctx.activation, ctx.interleave, ctx.b1_EH, ctx.expert_T, **_amax_kw(amax_dh, fc1.groups),
        **extra,
    )  # fmt: skip
    g1 = quantize_output_grad(fc1, dh_TH, _as_amax(amax_dh))
    with _on_side(side):
        dw1_EHD = _quantized_wgrad(fc1, g1, None if into is None else into[0])
    dx_TD = fc1.recipe.grouped_dgrad(g1, fc1.wq, fc1.x_dtype)
    _join(side, *(t for t in (dw2_EDF, dw1_EHD) if t is not None))
    db1_EH, db2_ED, dprobs_T = _bias_grads(
        ctx.b1_EH, ctx.b2_ED, probs, ctx.expert_T, ctx.tokens_per_expert_E, dy, dh_TH, dprobs_T
    )
    return dx_TD, dw1_EHD, db1_EH, dw2_EDF, db2_ED, dprobs_T


def _backward_quantized_dgrad(
    ctx: QuantizedFusedCtx, dy_TD: torch.Tensor, into: WgradTargets | None = None
) -> tuple[torch.Tensor, Any, Any]:
    """`_backward_quantized` as (dx, dprobs, wgrad): both output grads quantized and both data grads now, the
    weight-grad GEMMs on those quantized grads (and the bias grads) when `wgrad()` runs."""
    if ctx.fc1 is None or ctx.fc2 is None:
        raise RuntimeError("expert backward after a forward without grad")
    h, probs, fc1, fc2 = ctx.h_TH, ctx.probs_T, ctx.fc1, ctx.fc2
    if h.shape[0] == 0:
        dx, dw1, db1, dw2, db2, dprobs = _backward_quantized(ctx, dy_TD, into=into)
        return dx, dprobs, lambda: (dw1, db1, dw2, db2)
    dy = dy_TD.to(h.dtype).contiguous()
    kernels = _kernels(h.device)
    amax_dy, amax_dh = _amax_slots(kernels, fc2, dy, fc2.groups)
    g2 = quantize_output_grad(fc2, dy, _as_amax(amax_dy))
    da_TF = fc2.recipe.grouped_dgrad(g2, fc2.wq, fc2.x_dtype)
    extra = {} if kernels is _Reference else {"write_a": False}  # a's quantized copy was kept instead
    dh_TH, dprobs_T, _ = kernels.glu_backward(
        h, probs, da_TF, ctx.activation, ctx.interleave, ctx.b1_EH, ctx.expert_T, **_amax_kw(amax_dh, fc1.groups),
        **extra,
    )  # fmt: skip
    g1 = quantize_output_grad(fc1, dh_TH, _as_amax(amax_dh))
    dx_TD = fc1.recipe.grouped_dgrad(g1, fc1.wq, fc1.x_dtype)
    dprobs_T = _dprobs_with_b2(ctx.b2_ED, probs, ctx.expert_T, dy, dprobs_T)

    def wgrad() -> tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor, "torch.Tensor | None"]:
        dw2_EDF = _quantized_wgrad(fc2, g2, None if into is None else into[1])
        dw1_EHD = _quantized_wgrad(fc1, g1, None if into is None else into[0])
        db1_EH, db2_ED = _bias_only(ctx.b1_EH, ctx.b2_ED, probs, ctx.tokens_per_expert_E, dy, dh_TH)
        return dw1_EHD, db1_EH, dw2_EDF, db2_ED

    return dx_TD, dprobs_T, wgrad


def _quantized_wgrad(s: Any, gq: Any, into: list[torch.Tensor] | None) -> torch.Tensor | None:
    """dW of one linear under its recipe (`s` a SavedLinear, `gq` its quantized output grad), or, with `into`
    (gradient-accumulation fusion), added into those fp32 targets (None back): in the GEMM where the fp8 kernel
    applies, else the recipe's product then one add, what unfused routing would do."""
    if into is None:
        return s.recipe.grouped_wgrad(gq, s.xq)
    fused = s.recipe.mode != "emulate" and grouped_wgrad_accumulate_(gq, s.xq, into, s.recipe.fast_accum_backward)
    if not fused:
        dw = s.recipe.grouped_wgrad(gq, s.xq)
        with region(GRAD_ACCUMULATE):
            torch._foreach_add_(into, list(dw.unbind(0)))
    return None


def _amax_slots(
    kernels: Any, who: Any, first_TK: torch.Tensor, groups: Any
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Per-group amax slots (int32 `[G]` each, one allocation and one fill for both) for a GEMM input and for
    the activation kernel's output (forward: x and a; backward: dy and dh), when the next quantizer is current
    per-tensor scaling on its Triton path. The first slot comes back holding max |first_TK| per group; the
    second is zero, for the activation kernel to record into. Quantizers given an amax skip their own pass and
    zeroing (for a and dh one read of the tensor is saved). (None, None) otherwise. `who` carries the recipe
    (ExpertPrecision or SavedLinear); `first_TK` must be contiguous."""
    recipe = who.recipe
    if kernels is _Reference or type(recipe) is not TensorwiseRecipe or groups is None or first_TK.shape[0] == 0:
        return None, None  # delayed scaling measures the amax in its quantize pass already
    if not triton_fast_path(first_TK, recipe.activation_scheme()):
        return None, None
    from trainer.kernels.fp8_quant_triton import amax as measure_amax  # lazy: needs Triton

    slots = torch.zeros(2, groups.count, dtype=torch.int32, device=first_TK.device)
    measure_amax(first_TK.view(1, *first_TK.shape), groups.ids, groups.count, out=slots[0])
    return slots[0], slots[1]


def _amax_kw(slot: torch.Tensor | None, groups: Any) -> dict[str, Any]:
    return {} if slot is None else {"amax_groups": (groups.ids, slot)}


def _as_amax(slot: torch.Tensor | None) -> torch.Tensor | None:
    """The recorded bit patterns as the fp32 amax (non-negative floats order like their int32 bits)."""
    return None if slot is None else slot.view(torch.float32)


def _check_alignment(dtype: torch.dtype, *widths: int) -> None:
    """torch._grouped_mm wants 16-byte-aligned row strides: say so in the user's terms, not the kernel's."""
    elems = 16 // torch.empty(0, dtype=dtype).element_size()
    if any(w % elems for w in widths):
        raise MoectlError(
            f"the fused expert backend needs hidden size, fc1 width and expert ffn size {widths} to be multiples "
            f"of {elems} for {dtype} (torch._grouped_mm wants 16-byte-aligned strides)",
            "pick sizes that are multiples of 8, or set moe.backend: loop",
        )


def _add_row_bias(
    kernels: Any,
    y_TD: torch.Tensor,
    probs_T: torch.Tensor | None,
    b2_ED: torch.Tensor,
    expert_T: torch.Tensor,
) -> torch.Tensor:
    """y + probs * b2[expert]: in place in one pass on CUDA, plain torch elsewhere."""
    if kernels is _Reference:
        return expert_math.add_row_bias(y_TD, probs_T, b2_ED, expert_T)
    return kernels.add_row_bias_(y_TD, probs_T, b2_ED, expert_T)


def _empty_grads(ctx: FusedCtx, wgrad_into: WgradTargets | None = None,
                 wgrad_stale: WgradTargets | None = None) -> Grads:
    """Grads when no row was routed here: zeros for weights and biases, empty for x and probs. With
    `wgrad_into` the weight grads are added there, as always: nothing to add, stale targets zeroed; None back."""

    def zeros(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.zeros_like(t)

    dw1: torch.Tensor | None = torch.zeros_like(ctx.w1_EHD)
    dw2: torch.Tensor | None = torch.zeros_like(ctx.w2_EDF)
    if wgrad_into is not None:
        dw1 = dw2 = None
        for targets, stale in zip(wgrad_into, wgrad_stale or (None, None)):
            if stale is not None:
                settle_stale_(targets, stale)
    dprobs = None if ctx.probs_T is None else torch.zeros_like(ctx.probs_T)
    return (torch.zeros_like(ctx.x_TD), dw1, zeros(ctx.b1_EH), dw2, zeros(ctx.b2_ED), dprobs)
