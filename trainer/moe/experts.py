"""GroupedMLP: the routed experts of one MoE layer, in either parameter layout, over any expert backend.

Shape suffixes (logical shapes, torchtitan style):
    T  tokens                      D  hidden size
    F  expert ffn size             H  fc1 output: 2F for gated activations, F for squared_relu
    E  local experts               K  experts per token (router top-k)
    P  permuted rows: T*K routings sorted by expert, maybe dropped (capacity) or padded (alignment)

Layouts (docs/architecture.md, "Expert layouts"):
    single grouped: `linear_fc1.weight` `[E, H, D]`, `linear_fc2.weight` `[E, D, F]` (biases `bias` `[E, out]`
                    with `single_grouped_bias`)
    per-expert:     `linear_fc1.weight0..weight{E-1}` `[H, D]`, ... (biases `bias0..`)
Both start from one RNG draw of the whole `[E, out, in]` tensor (per-expert params are its slices) and run
the same backend on the same values: the per-expert layout stacks its weights first. So forward and every
grad are bitwise identical across layouts by construction, and the tests hold us to it. (One exception: under
`moe.defer_expert_wgrad` on a GPU, per-expert grads that are not whole rows of one matrix take the pointer
kernel, which adds each micro-batch in its own launch where the TMA kernel sums four in one accumulator:
equal to the last bits, not bitwise. `DistributedModel`'s grad buffer lays per-expert grads out as the grouped
grad's rows, so there they are whole rows exactly when the grouped grad is, and both take the same kernel.)

Weight grads never go through autograd's AccumulateGrad for the layout's sake: one autograd Function calls
the backend and routes `dw_E..` to the params (the whole `[E, out, in]` grad, or its `unbind(0)` slices)
through `trainer.main_grad.accumulate_wgrad`, which lands them in fp32 `main_grad` under
`gradient_accumulation_fusion` (then `.grad` stays None).

Low precision (`recipe`): the module owns the recipe and its per-layer scaling state and hands the backend
an `ExpertPrecision` on every call (expert_precision.py); fc1 and fc2 then run through the recipe's
quantized grouped GEMMs. Layout parity is unchanged: both layouts quantize the same `[E, out, in]` values.
The weight grads come back in fp32, or bf16 from a native fp8 grouped wgrad (the kernel's output, as the bf16
backends'); autograd casts them to the params' dtype, `main_grad` accumulates them in fp32.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from moectl.core.config.schema import MoEConfig
from moectl.core.errors import MoectlError
from moectl.core.facts import GLU_ROWS_ATTR, GluRows
from trainer import grad_sq
from trainer.linear import state_for_call
from trainer.main_grad import accumulate_late_wgrad, accumulate_wgrad, grad_ready, settle_stale, stale_flag
from trainer.moe.backends import (
    ExpertBackend,
    defers_wgrad,
    get_backend,
    leaves_wgrad_sq,
    overwrites_stale_wgrad,
    supports_delayed_wgrad,
    supports_precision,
    supports_recipe_wgrad_into,
    supports_wgrad_into,
)
from trainer.init_weights import normal_
from trainer.moe.delayed_wgrad import DelayedWgrad
from trainer.moe.expert_math import ExpertSpec
from trainer.moe.expert_precision import ExpertPrecision
from trainer.moe import wgrad_deferral
from trainer.precision import QuantizedTensor, Recipe


def _init_EOI(E: int, out: int, inp: int, std: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One normal draw of the whole `[E, out, in]` weight, in fp32 (the layouts slice the same values)."""
    device = generator.device if generator is not None else None
    return normal_(torch.empty(E, out, inp, dtype=torch.float32, device=device), std, generator)


class GroupedLinearParams(nn.Module):
    """The parameters of one expert linear (fc1 or fc2) in one layout; the math lives in the backend.

    `grouped_weight=True`: `weight` `[E, out, in]`; else `weight0..weight{E-1}` `[out, in]`.
    Bias (when `bias`): `bias` `[E, out]` if `grouped_bias`, else `bias0..bias{E-1}` `[out]`; zero init.
    `glu_rows` (a gated fc1): set on every weight param as `facts.GLU_ROWS_ATTR`, the gate/up row layout an
    optimizer may split by (Muon's `optimizer.muon_split_glu`).

    `quantized_weight` (the low-precision param-gather hook): None, or the whole `[E, out, in]` weight as a
    `QuantizedTensor` of the layer's recipe whatever the layout (`QuantizedTensor.stack` for per-expert
    params). When set, the recipe GEMMs use it instead of quantizing the weight params, whose grads are
    still routed to those params as usual (so they need only their shape and `main_grad`). Whoever sets it
    keeps it current (re-sets it after every gather); the module never clears it.
    """

    def __init__(
        self,
        weight_EOI: torch.Tensor,
        *,
        bias: bool,
        grouped_weight: bool,
        grouped_bias: bool,
        dtype: torch.dtype,
        glu_rows: Optional[GluRows] = None,
    ) -> None:
        super().__init__()
        E, out, _ = weight_EOI.shape
        self.num_experts = E
        self.grouped_weight = grouped_weight
        self.grouped_bias = grouped_bias
        self.has_bias = bias
        self.quantized_weight: Optional[QuantizedTensor] = None
        weight_EOI = weight_EOI.to(dtype)
        if grouped_weight:
            self.weight = nn.Parameter(weight_EOI.clone())
        else:
            for e in range(E):
                self.register_parameter(f"weight{e}", nn.Parameter(weight_EOI[e].clone()))
        if bias:
            bias_EO = torch.zeros(E, out, dtype=dtype, device=weight_EOI.device)
            if grouped_bias:
                self.bias = nn.Parameter(bias_EO)
            else:
                for e in range(E):
                    self.register_parameter(f"bias{e}", nn.Parameter(bias_EO[e].clone()))
        for p in self.parameters():
            p.expert_parallel = True  # type: ignore[attr-defined]  # reduced over the expert-dp group
        if glu_rows is not None:  # a gated fc1: every weight slice is gate and up rows (facts.GluRows)
            for p in self.weight_params():
                setattr(p, GLU_ROWS_ATTR, glu_rows)

    def weight_params(self) -> list[nn.Parameter]:
        """The weight parameter(s), in expert order."""
        if self.grouped_weight:
            return [self.weight]
        return [getattr(self, f"weight{e}") for e in range(self.num_experts)]

    def bias_params(self) -> list[nn.Parameter]:
        """The bias parameter(s), in expert order; empty without bias."""
        if not self.has_bias:
            return []
        if self.grouped_bias:
            return [self.bias]
        return [getattr(self, f"bias{e}") for e in range(self.num_experts)]

    def param_runs(self) -> dict[str, list[nn.Parameter]]:
        """The per-expert params that stand for one grouped tensor, by that tensor's name (`weight`, `bias`),
        in expert order (E = 1 included, a run of one); grouped params are absent. `DistributedModel` lays each
        run out where, and exactly as, the grouped tensor would lie (`trainer/distributed/layout.py`), so the
        grad buffers, and every sum over them (the grad norm), are the same in both layouts."""
        runs: dict[str, list[nn.Parameter]] = {}
        if not self.grouped_weight:
            runs["weight"] = self.weight_params()
        if self.has_bias and not self.grouped_bias:
            runs["bias"] = self.bias_params()
        return runs

    @staticmethod
    def as_grouped(params: list[torch.Tensor], grouped: bool) -> Optional[torch.Tensor]:
        """The `[E, ...]` tensor a backend reads: the grouped param itself, or the per-expert params stacked."""
        if not params:
            return None
        return params[0] if grouped else torch.stack(params)

    def weight_EOI(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The `[E, out, in]` weight a backend reads. With `quantized_weight` set the backend reads only its
        shape, so per-expert params are not stacked (that would be a full-size copy on every call, of
        placeholders when param gather keeps no high-precision weights)."""
        if self.quantized_weight is not None and not self.grouped_weight:
            return params[0].unsqueeze(0).expand(len(params), *params[0].shape)
        return self.as_grouped(params, self.grouped_weight)  # type: ignore[return-value]

    def wgrad_targets(self, params: list[nn.Parameter]) -> Optional[list[torch.Tensor]]:
        """The E fp32 `[out, in]` main_grad matrices the weight grads can be accumulated into (gradient-
        accumulation fusion), or None where a param has no fp32 main_grad."""
        grads = [getattr(p, "main_grad", None) for p in params]
        if any(g is None or g.dtype != torch.float32 for g in grads):
            return None
        return list(grads[0].unbind(0)) if self.grouped_weight else grads  # type: ignore[arg-type]

    def wgrad_stale(self, params: list[nn.Parameter]) -> Optional[list[torch.Tensor]]:
        """The E targets' stale flags (`wgrad_targets` order; a grouped weight's E targets share its one flag),
        or None where the weights have none. Weights flagged only in part are settled and get None."""
        flags = [stale_flag(p) for p in params]
        if all(f is None for f in flags):
            return None
        if any(f is None for f in flags):
            for p in params:
                settle_stale(p)
            return None
        return flags * self.num_experts if self.grouped_weight else flags  # type: ignore[return-value]

    @staticmethod
    def route_late_grads(params: list[nn.Parameter], grad_E: Optional[torch.Tensor], grouped: bool, fuse: bool) -> None:
        """`route_grads` for grads computed after the backward returned None for the params (delayed
        wgrad): accumulated, and the grad hooks fired, as autograd would have (`accumulate_late_wgrad`)."""
        if not params or grad_E is None:
            return
        grads = [grad_E] if grouped else list(grad_E.unbind(0))
        for p, g in zip(params, grads):
            accumulate_late_wgrad(p, g, fuse)

    @staticmethod
    def route_grads(
        params: list[nn.Parameter], grad_E: Optional[torch.Tensor], grouped: bool, fuse: bool, report: bool = True
    ) -> list[Optional[torch.Tensor]]:
        """Per-param grads for autograd (None when fused into `main_grad`, or when there is no grad); `report`:
        whether fused grads are reported complete (`accumulate_wgrad`)."""
        if not params:
            return []
        if grad_E is None:
            return [None] * len(params)
        grads = [grad_E] if grouped else list(grad_E.unbind(0))
        return [accumulate_wgrad(p, g, fuse, report) for p, g in zip(params, grads)]


class ChunkReports:
    """The backwards of one forward's n expert calls (a layer run on its rows in chunks): a fused weight grad
    is summed over all n, so only the last backward to run reports it complete (`grad_ready` once each)."""

    def __init__(self, calls: int) -> None:
        self.left = calls

    def last(self) -> bool:
        """Count one backward; True for the last of them."""
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("more expert backwards than chunks in one forward")
        return self.left == 0


class _ExpertMLPFunction(torch.autograd.Function):
    """Calls the backend; routes weight grads through the layout and the main_grad seam."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x_PD: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        probs_P: Optional[torch.Tensor],
        module: "GroupedMLP",
        backend: ExpertBackend,
        precision: Optional[ExpertPrecision],
        n_params: tuple[int, int, int, int],
        *params: nn.Parameter,
    ) -> torch.Tensor:
        groups, i = [], 0
        for n in n_params:
            groups.append(list(params[i : i + n]))
            i += n
        fc1, fc2 = module.linear_fc1, module.linear_fc2
        w1_EHD = fc1.weight_EOI(groups[0])
        b1_EH = fc1.as_grouped(groups[1], fc1.grouped_bias)
        w2_EDF = fc2.weight_EOI(groups[2])
        b2_ED = fc2.as_grouped(groups[3], fc2.grouped_bias)
        extra = {} if precision is None else {"precision": precision}
        y_PD, ctx.backend_ctx = backend.forward(
            x_PD, w1_EHD, b1_EH, w2_EDF, b2_ED, tokens_per_expert_E, probs_P, module.spec, **extra
        )
        ctx.backend, ctx.module, ctx.groups, ctx.precision = backend, module, groups, precision
        ctx.has_probs = probs_P is not None
        ctx.reports = module._chunk_reports  # None: this call's backward reports the weight grads
        return y_PD

    @staticmethod
    def backward(ctx: Any, dy_PD: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        if ctx.backend_ctx is None:
            raise RuntimeError("GroupedMLP's backward ran twice on one forward (retain_graph is not supported)")
        if ctx.module.delayed is not None:
            return _ExpertMLPFunction._backward_delayed(ctx, dy_PD)
        fc1, fc2 = ctx.module.linear_fc1, ctx.module.linear_fc2
        fuse = ctx.module.gradient_accumulation_fusion
        w1, b1, w2, b2 = ctx.groups
        extra = _ExpertMLPFunction._wgrad_kwargs(ctx)
        into = extra.get("wgrad_into")
        report = ctx.reports is None or ctx.reports.last()  # the last chunk's backward reports for all of them
        # The step's last add into these grads: the kernel leaves their sums of squares for the norm (grad_sq.py).
        final = into is not None and report and grad_sq.armed()
        sq: list[torch.Tensor] = []
        if final and ctx.precision is None and leaves_wgrad_sq(ctx.backend):
            extra["wgrad_sq"] = sq
        # A step's micro-batches but the last keep their wgrad operands for it (wgrad_deferral.py).
        defer = wgrad_deferral.phase()
        if (defer is not None and into is not None and ctx.precision is None and ctx.reports is None
                and defers_wgrad(ctx.backend)):
            extra.update(wgrad_stash=ctx.module.wgrad_stash, wgrad_defer=defer)
        dx_PD, dw1_EHD, db1_EH, dw2_EDF, db2_ED, dprobs_P = ctx.backend.backward(ctx.backend_ctx, dy_PD, **extra)
        ctx.backend_ctx = None  # free activations now, not when the graph dies
        if final:
            assert into is not None
            for targets, partials in zip(into, sq or (None, None)):
                grad_sq.record(targets, partials)
        if into is not None and report:  # the backend accumulated the weight grads: report, as accumulate_wgrad does
            for p in (*w2, *w1):
                grad_ready(p)
        # Order matters only for grad_ready hooks (bucket completion): fc2 then fc1, the order backward runs.
        g_w2 = fc2.route_grads(w2, dw2_EDF, fc2.grouped_weight, fuse, report)
        g_b2 = fc2.route_grads(b2, db2_ED, fc2.grouped_bias, fuse, report)
        g_w1 = fc1.route_grads(w1, dw1_EHD, fc1.grouped_weight, fuse, report)
        g_b1 = fc1.route_grads(b1, db1_EH, fc1.grouped_bias, fuse, report)
        dprobs_P = dprobs_P if ctx.has_probs else None
        return (dx_PD, None, dprobs_P, None, None, None, None, *g_w1, *g_b1, *g_w2, *g_b2)

    @staticmethod
    def _wgrad_kwargs(ctx: Any) -> dict[str, Any]:
        """The backend's weight-grad keywords: `wgrad_into` (`_wgrad_into`), and `wgrad_stale`, the targets'
        stale flags (trainer/main_grad.py), where the backend overwrites flagged targets in this precision.
        Flagged targets it would only add into are settled here first."""
        into = _ExpertMLPFunction._wgrad_into(ctx)
        if into is None:
            return {}  # the grads come back and are routed: accumulate_wgrad settles them
        w1, _, w2, _ = ctx.groups
        stale = (ctx.module.linear_fc1.wgrad_stale(w1), ctx.module.linear_fc2.wgrad_stale(w2))
        if stale[0] is not None and stale[1] is not None and ctx.precision is None and overwrites_stale_wgrad(ctx.backend):
            return {"wgrad_into": into, "wgrad_stale": stale}
        for p in (*w1, *w2):
            settle_stale(p)
        return {"wgrad_into": into}

    @staticmethod
    def _wgrad_into(ctx: Any) -> Optional[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Where the backend accumulates the weight grads itself (gradient-accumulation fusion, a backend that
        can, fp32 main_grads; under a recipe too), or None: the grads then come back and are routed."""
        w1, _, w2, _ = ctx.groups
        can = supports_wgrad_into if ctx.precision is None else supports_recipe_wgrad_into
        if not (ctx.module.gradient_accumulation_fusion and can(ctx.backend)):
            return None
        t1, t2 = ctx.module.linear_fc1.wgrad_targets(w1), ctx.module.linear_fc2.wgrad_targets(w2)
        return (t1, t2) if t1 is not None and t2 is not None else None

    @staticmethod
    def _backward_delayed(ctx: Any, dy_PD: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        """Data grads now; the weight and bias grads deferred to the layer's flush point (delayed_wgrad.py)."""
        extra = _ExpertMLPFunction._wgrad_kwargs(ctx)
        into = extra.get("wgrad_into")
        dx_PD, dprobs_P, wgrad = ctx.backend.backward_dgrad(ctx.backend_ctx, dy_PD, **extra)
        ctx.backend_ctx = None
        module, (w1, b1, w2, b2) = ctx.module, ctx.groups
        fc1, fc2 = module.linear_fc1, module.linear_fc2
        fuse = module.gradient_accumulation_fusion

        def deliver() -> None:
            dw1_EHD, db1_EH, dw2_EDF, db2_ED = wgrad()
            if into is not None:  # accumulated by the backend: report them, as accumulate_wgrad does
                for p in (*w2, *w1):
                    grad_ready(p)
            # fc2 then fc1, weight then bias: the order the undelayed backward routes them in
            fc2.route_late_grads(w2, dw2_EDF, fc2.grouped_weight, fuse)
            fc2.route_late_grads(b2, db2_ED, fc2.grouped_bias, fuse)
            fc1.route_late_grads(w1, dw1_EHD, fc1.grouped_weight, fuse)
            fc1.route_late_grads(b1, db1_EH, fc1.grouped_bias, fuse)

        module.delayed.defer(deliver)
        n_params = len(w1) + len(b1) + len(w2) + len(b2)
        return (dx_PD, None, dprobs_P if ctx.has_probs else None, None, None, None, None, *([None] * n_params))


class GroupedMLP(nn.Module):
    """The experts of one MoE layer: `y = probs * (fc2(act(fc1(x) + b1)) + b2)` per expert segment.

    Args:
        cfg: the `moe` config section (num_experts, ffn_hidden_size, activation, add_bias, layouts, backend,
            glu_interleave_size).
        hidden_size: D.
        num_local_experts: experts on this rank (default `cfg.num_experts`; expert parallelism slices them).
        first_expert: global index of this rank's first expert (expert parallelism: ep_rank * num_local_experts).
        init_std: std of the normal init of fc1 (and of fc2 unless `output_init_std` is given).
        output_init_std: std of fc2's init (e.g. Megatron's std / sqrt(2 * num_layers)); None = init_std.
        params_dtype: dtype of the parameters (the init is drawn in fp32, then cast).
        generator: RNG for the init (fc1 drawn first, then fc2).
        gradient_accumulation_fusion: accumulate weight grads into `param.main_grad` (fp32), `.grad` unused.
        recipe: a low-precision recipe (`trainer.precision.get_recipe`) for fc1 and fc2, or None (the params'
            dtype). The rows of every expert must then be a multiple of `recipe.align_size` (MoELayer's align).
        delay_wgrad: compute the weight and bias grads after the data grads, when `delayed.flush()` runs
            (`cfg.delay_wgrad_compute`; MoELayer hands the flush to its dispatcher: delayed_wgrad.py).
    """

    def __init__(
        self,
        cfg: MoEConfig,
        hidden_size: int,
        *,
        num_local_experts: Optional[int] = None,
        first_expert: int = 0,
        init_std: float = 0.02,
        output_init_std: Optional[float] = None,
        params_dtype: torch.dtype = torch.float32,
        generator: Optional[torch.Generator] = None,
        gradient_accumulation_fusion: bool = False,
        recipe: Optional[Recipe] = None,
        delay_wgrad: bool = False,
    ) -> None:
        super().__init__()
        E = num_local_experts if num_local_experts is not None else cfg.num_experts
        self.spec = ExpertSpec(cfg.activation, cfg.ffn_hidden_size, cfg.glu_interleave_size)
        self.num_local_experts = E
        self.hidden_size = hidden_size
        self.backend_name = cfg.backend
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        H, Fd, D = self.spec.fc1_out, cfg.ffn_hidden_size, hidden_size
        # single_grouped_bias without add_bias has nothing to store: no bias either way.
        layout = dict(bias=cfg.add_bias, grouped_weight=cfg.single_grouped_weight, grouped_bias=cfg.single_grouped_bias)
        # Every rank draws the whole [num_experts, out, in] weights (one draw each, as the ep=1 model does) and
        # keeps its experts' slice: an expert-parallel model starts from exactly the ep=1 model, in both layouts,
        # and the generator advances alike on every rank (so the layers drawn after agree too).
        if first_expert < 0 or first_expert + E > cfg.num_experts:
            raise ValueError(f"experts [{first_expert}, {first_expert + E}) are not among {cfg.num_experts} experts")
        mine = slice(first_expert, first_expert + E)
        w1_EHD = _init_EOI(cfg.num_experts, H, D, init_std, generator)[mine]
        fc2_std = init_std if output_init_std is None else output_init_std
        w2_EDF = _init_EOI(cfg.num_experts, D, Fd, fc2_std, generator)[mine]
        glu = GluRows(cfg.glu_interleave_size) if self.spec.gated else None
        self.linear_fc1 = GroupedLinearParams(w1_EHD, dtype=params_dtype, glu_rows=glu, **layout)
        self.linear_fc2 = GroupedLinearParams(w2_EDF, dtype=params_dtype, **layout)
        self._backends: dict[torch.device, ExpertBackend] = {}
        self.recipe = recipe
        self.recipe_states: dict[str, Any] = {}  # the recipe's scaling state (delayed: amax histories)
        #: the deferred weight grads of this layer's backward (None: computed with the data grads)
        self.delayed: Optional[DelayedWgrad] = DelayedWgrad() if delay_wgrad else None
        self._chunk_reports: Optional[ChunkReports] = None  # set by `chunked` for the calls inside it
        #: the wgrad operands of this step's earlier micro-batches under `moe.defer_expert_wgrad`
        self.wgrad_stash = wgrad_deferral.WgradStash()

    def stale_grad_params(self, device: torch.device) -> list[nn.Parameter]:
        """The weights whose grads this layer overwrites when they are flagged stale (trainer/main_grad.py), so
        zero_grad need not fill them: fc1's and fc2's under gradient-accumulation fusion without a recipe, on a
        backend that overwrites (`fused`); else none."""
        if not self.gradient_accumulation_fusion or self.recipe is not None:
            return []
        if not overwrites_stale_wgrad(self.backend(device)):
            return []
        return [*self.linear_fc1.weight_params(), *self.linear_fc2.weight_params()]

    def backend(self, device: torch.device) -> ExpertBackend:
        """The configured backend for `device`, resolved once per device (`auto` may differ on CPU and CUDA)."""
        if device not in self._backends:
            backend = get_backend(self.backend_name, device)
            if self.recipe is not None and not supports_precision(backend):
                raise MoectlError(
                    f"expert backend {backend.name!r} has no low-precision path for recipe {self.recipe.name}",
                    "set moe.backend to grouped, fused or loop, or turn fp8/fp4 off",
                )
            if self.delayed is not None and not supports_delayed_wgrad(backend):
                raise MoectlError(
                    f"expert backend {backend.name!r} cannot delay its weight grads (moe.delay_wgrad_compute=true)",
                    "set moe.backend to grouped, fused or loop, or moe.delay_wgrad_compute=false",
                )
            self._backends[device] = backend
        return self._backends[device]

    @contextlib.contextmanager
    def chunked(self, calls: int) -> Iterator[None]:
        """The `calls` forwards inside are one layer's rows in chunks: their weight grads are reported once,
        by the last backward (grad buckets count one report per param per backward)."""
        if self.delayed is not None:
            raise ValueError("chunked expert calls and delayed wgrad do not mix (MOE067)")
        self._chunk_reports = ChunkReports(calls) if torch.is_grad_enabled() else None
        try:
            yield
        finally:
            self._chunk_reports = None

    def forward(
        self, x_PD: torch.Tensor, tokens_per_expert_E: torch.Tensor, probs_P: Optional[torch.Tensor],
        rows_each: Optional[int] = None,
    ) -> torch.Tensor:
        """Expert outputs `[P, D]` for rows grouped by expert (`tokens_per_expert_E[e]` rows each, summing to P).

        `probs_P` scales each row's output (padded rows carry 0); None = no scaling. `rows_each`: every
        expert's row count when the dispatcher made them equal (drop-and-pad), so a recipe's token groups
        need no device read; None when data-dependent.
        """
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        groups = (fc1.weight_params(), fc1.bias_params(), fc2.weight_params(), fc2.bias_params())
        n_params = tuple(len(g) for g in groups)
        flat = [p for g in groups for p in g]
        return _ExpertMLPFunction.apply(
            x_PD, tokens_per_expert_E, probs_P, self, self.backend(x_PD.device),
            self._precision(x_PD, flat, rows_each), n_params, *flat,
        )  # fmt: skip

    def _precision(
        self, x_PD: torch.Tensor, params: list[nn.Parameter], rows_each: Optional[int] = None
    ) -> Optional[ExpertPrecision]:
        """This call's recipe and state (None without a recipe); a call without grad (eval) gets a copy of
        the state, so it does not move delayed scaling's histories."""
        if self.recipe is None:
            return None
        need_grad = torch.is_grad_enabled() and (x_PD.requires_grad or any(p.requires_grad for p in params))
        return ExpertPrecision(
            self.recipe,
            state_for_call(self.recipe_states, need_grad),
            need_grad,
            {"fc1": self.linear_fc1.quantized_weight, "fc2": self.linear_fc2.quantized_weight},
            rows_each,
        )

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"experts={self.num_local_experts}, hidden={self.hidden_size}, ffn={s.ffn_size}, act={s.activation}, "
            f"interleave={s.glu_interleave_size}, backend={self.backend_name}, "
            f"single_grouped_weight={self.linear_fc1.grouped_weight}"
            + (f", recipe={self.recipe.name}" if self.recipe is not None else "")
        )
