"""Expert MLP backends: the kernels behind `GroupedMLP`, over plain tensors in the `[E, out, in]` layout.

The contract (design/architecture.md, "Interfaces between packages"); every backend is an object with

    forward(x_TD, w1_EHD, b1_EH, w2_EDF, b2_ED, tokens_per_expert_E, probs_T, spec) -> (y_TD, ctx)
    backward(ctx, dy_TD) -> (dx_TD, dw1_EHD, db1_EH, dw2_EDF, db2_ED, dprobs_T)

computing `y = probs[:, None] * (fc2(act(fc1(x) + b1)) + b2)` expert by expert over consecutive row
segments (`tokens_per_expert_E[e]` rows for expert e, in expert order). Biases and probs may be None; their
grads are then None. `ctx` is opaque to the caller. Backends never see parameters, layouts or main_grad:
`experts.py` owns those, so every layout runs the same kernels on the same values.

Shapes (torchtitan-style suffixes; logical shapes):
    T  rows given to the expert MLP (permuted, maybe padded token rows; `P` in dispatch/experts)
    D  hidden size                 F  expert ffn size
    H  fc1 output: 2F for gated activations ([gate; up], or interleaved blocks), F otherwise
    E  local experts

Low precision: a backend with a recipe path also takes `forward(..., spec, precision=ExpertPrecision)`
(`expert_precision.py`): fc1 and fc2 then run through the recipe's quantized (grouped) GEMMs, weight grads
come back fp32, and every expert segment must be a multiple of `recipe.align_size` rows. `loop`, `grouped`
and `fused` have one; `GroupedMLP` refuses a recipe for a backend without (`supports_precision`).

Dtypes: weights and x share one dtype; probs may be fp32 (the router's). Prob scaling and dprobs are
computed in fp32 and the output is cast back to x's dtype, so bf16 runs do not round the probs.

Backends by name (`get_backend`): `loop` (reference), `grouped` (torch._grouped_mm), `fused` (lazily
imported from `trainer.kernels.fused_expert_mlp:FusedBackend`), `auto` (-> `fused` on CUDA, else `grouped`; see `_resolve_auto`).
A registry target is a class or factory; it is called as `target(device)` when it takes an argument, else as
`target()`, and must return an object with `name`, `forward`, `backward`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch
import torch.nn.functional as F

from moectl.core.errors import MoectlError

if TYPE_CHECKING:
    from trainer.moe.expert_precision import ExpertPrecision

Tensor = torch.Tensor
OptTensor = Optional[torch.Tensor]

ACTIVATIONS = ("swiglu", "quick_geglu", "squared_relu")
GATED = ("swiglu", "quick_geglu")
QUICK_GELU_ALPHA = 1.702  # quick_gelu(x) = x * sigmoid(1.702 x), as in CLIP and TE's ScaledClampedQGeGLU


@dataclass(frozen=True)
class ExpertSpec:
    """What the expert MLP computes, independent of layout and kernels."""

    activation: str  # one of ACTIVATIONS
    ffn_size: int  # F
    glu_interleave_size: Optional[int] = None  # I: fc1 rows stored as [g(I), u(I), g(I), ...]; None = [gate; up]

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise MoectlError(f"unknown expert activation {self.activation!r}", f"use one of {', '.join(ACTIVATIONS)}")
        I = self.glu_interleave_size
        if I is not None:
            if not self.gated:
                raise MoectlError(
                    f"glu_interleave_size={I} needs a gated activation, not {self.activation}",
                    "set moe.glu_interleave_size: null or use swiglu/quick_geglu",
                )
            if I <= 0 or self.ffn_size % I:
                raise MoectlError(
                    f"glu_interleave_size={I} must be positive and divide moe.ffn_hidden_size={self.ffn_size}",
                    "pick an interleave size that divides the expert ffn size",
                )

    @property
    def gated(self) -> bool:
        """Whether fc1 produces gate and up halves (H = 2F)."""
        return self.activation in GATED

    @property
    def fc1_out(self) -> int:
        """H: rows of the fc1 weight."""
        return 2 * self.ffn_size if self.gated else self.ffn_size


class ExpertBackend(Protocol):
    """The backend protocol (see the module docstring for the math and shapes)."""

    name: str

    def forward(
        self,
        x_TD: torch.Tensor,
        w1_EHD: torch.Tensor,
        b1_EH: Optional[torch.Tensor],
        w2_EDF: torch.Tensor,
        b2_ED: Optional[torch.Tensor],
        tokens_per_expert_E: torch.Tensor,
        probs_T: Optional[torch.Tensor],
        spec: ExpertSpec,
    ) -> tuple[torch.Tensor, Any]: ...

    def backward(self, ctx: Any, dy_TD: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]: ...


def supports_precision(backend: ExpertBackend) -> bool:
    """Whether `backend.forward` takes a low-precision recipe (the keyword `precision`)."""
    try:
        return "precision" in inspect.signature(backend.forward).parameters
    except (TypeError, ValueError):
        return False


# ----------------------------------------------------------------------------------------------------------
# fc1 layout and activations (shared by the backends and by checkpoint conversion)


def interleave_glu(t: torch.Tensor, interleave_size: int, dim: int = -2) -> torch.Tensor:
    """Contiguous `[gate; up]` -> blocks `[g(I), u(I), g(I), u(I), ...]` along `dim` (size 2F).

    Interleaved index b*2I + h*I + o holds contiguous index h*F + b*I + o (h = 0 gate, 1 up).
    """
    dim = dim % t.dim()
    H = t.shape[dim]
    I = interleave_size
    shape = t.shape[:dim] + (2, H // (2 * I), I) + t.shape[dim + 1 :]
    return t.reshape(shape).transpose(dim, dim + 1).reshape(t.shape)


def deinterleave_glu(t: torch.Tensor, interleave_size: int, dim: int = -2) -> torch.Tensor:
    """Inverse of `interleave_glu`: blocks `[g(I), u(I), ...]` -> contiguous `[gate; up]` along `dim`."""
    dim = dim % t.dim()
    H = t.shape[dim]
    I = interleave_size
    shape = t.shape[:dim] + (H // (2 * I), 2, I) + t.shape[dim + 1 :]
    return t.reshape(shape).transpose(dim, dim + 1).reshape(t.shape)


def split_glu(h_TH: torch.Tensor, spec: ExpertSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves `[T, F]` of an fc1 output, reading the interleaved layout natively."""
    if spec.glu_interleave_size is None:
        return h_TH[:, : spec.ffn_size], h_TH[:, spec.ffn_size :]
    I = spec.glu_interleave_size
    h_TBhI = h_TH.reshape(h_TH.shape[0], spec.ffn_size // I, 2, I)
    return h_TBhI[:, :, 0].reshape(-1, spec.ffn_size), h_TBhI[:, :, 1].reshape(-1, spec.ffn_size)


def join_glu(g_TF: torch.Tensor, u_TF: torch.Tensor, spec: ExpertSpec) -> torch.Tensor:
    """Inverse of `split_glu`: gate and up `[T, F]` -> `[T, H]` in the fc1 layout."""
    if spec.glu_interleave_size is None:
        return torch.cat([g_TF, u_TF], dim=1)
    I = spec.glu_interleave_size
    T = g_TF.shape[0]
    return torch.stack([g_TF.reshape(T, -1, I), u_TF.reshape(T, -1, I)], dim=2).reshape(T, 2 * spec.ffn_size)


def activation(h_TH: torch.Tensor, spec: ExpertSpec) -> torch.Tensor:
    """act(h) -> `[T, F]`, written with differentiable torch ops (the loop backend autograds through it)."""
    if spec.activation == "squared_relu":
        return torch.square(F.relu(h_TH))
    g_TF, u_TF = split_glu(h_TH, spec)
    if spec.activation == "swiglu":
        return F.silu(g_TF) * u_TF
    return g_TF * torch.sigmoid(QUICK_GELU_ALPHA * g_TF) * u_TF


def activation_backward(h_TH: torch.Tensor, da_TF: torch.Tensor, spec: ExpertSpec) -> torch.Tensor:
    """d act / d h, hand-written (the grouped backend's backward; checked against autograd via `loop`)."""
    if spec.activation == "squared_relu":
        return da_TF * 2.0 * F.relu(h_TH)
    g_TF, u_TF = split_glu(h_TH, spec)
    alpha = 1.0 if spec.activation == "swiglu" else QUICK_GELU_ALPHA
    s_TF = torch.sigmoid(alpha * g_TF)
    act_g_TF = g_TF * s_TF  # silu(g) or quick_gelu(g)
    dact_g_TF = s_TF + alpha * act_g_TF * (1.0 - s_TF)  # d/dg [g * sigmoid(alpha g)]
    return join_glu(da_TF * u_TF * dact_g_TF, da_TF * act_g_TF, spec)


def _scale_by_probs(z_TD: torch.Tensor, probs_T: Optional[torch.Tensor]) -> torch.Tensor:
    """probs * z in fp32, back in z's dtype (a bf16 prob would lose ~3 digits of the routing weight)."""
    if probs_T is None:
        return z_TD
    return (z_TD.float() * probs_T.float()[:, None]).to(z_TD.dtype)


def _unscale_grad(
    dy_TD: torch.Tensor, z_TD: Optional[torch.Tensor], probs_T: Optional[torch.Tensor]
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(dz, dprobs) for y = probs * z; padded rows (prob 0) get dz = 0, which keeps them out of wgrads."""
    if probs_T is None or z_TD is None:
        return dy_TD, None
    dz_TD = (dy_TD.float() * probs_T.float()[:, None]).to(dy_TD.dtype)
    dprobs_T = (dy_TD.float() * z_TD.float()).sum(dim=1).to(probs_T.dtype)
    return dz_TD, dprobs_T


# ----------------------------------------------------------------------------------------------------------
# loop: the reference


@dataclass
class _LoopCtx:
    x_TD: torch.Tensor
    w1_EHD: torch.Tensor
    b1_EH: Optional[torch.Tensor]
    w2_EDF: torch.Tensor
    b2_ED: Optional[torch.Tensor]
    counts: list[int]
    probs_T: Optional[torch.Tensor]
    spec: ExpertSpec


class LoopBackend:
    """Per-expert matmuls. Backward recomputes each expert's graph and asks autograd, so it is obviously right.

    It syncs the host for the counts and launches ~10 small kernels per expert: a reference, not a fast path.
    """

    name = "loop"

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = device

    @staticmethod
    def _expert(
        x: Tensor, w1: Tensor, b1: OptTensor, w2: Tensor, b2: OptTensor, p: OptTensor, spec: ExpertSpec
    ) -> Tensor:
        h = x @ w1.t()
        if b1 is not None:
            h = h + b1
        z = activation(h, spec) @ w2.t()
        if b2 is not None:
            z = z + b2
        return _scale_by_probs(z, p)

    def forward(
        self, x_TD: Tensor, w1_EHD: Tensor, b1_EH: OptTensor, w2_EDF: Tensor, b2_ED: OptTensor,
        tokens_per_expert_E: Tensor, probs_T: OptTensor, spec: ExpertSpec,
        precision: Optional["ExpertPrecision"] = None,
    ) -> tuple[Tensor, Any]:  # fmt: skip
        """See the module docstring; with `precision`, expert by expert in the recipe (quantized_mlp.py)."""
        if precision is not None:
            from trainer.moe import quantized_mlp

            return quantized_mlp.forward(
                False, x_TD, w1_EHD, b1_EH, w2_EDF, b2_ED, tokens_per_expert_E, probs_T, spec, precision
            )
        counts = [int(c) for c in tokens_per_expert_E.tolist()]
        y_TD = x_TD.new_zeros(x_TD.shape[0], w2_EDF.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n:
                sl = slice(start, start + n)
                y_TD[sl] = self._expert(
                    x_TD[sl], w1_EHD[e], None if b1_EH is None else b1_EH[e], w2_EDF[e],
                    None if b2_ED is None else b2_ED[e], None if probs_T is None else probs_T[sl], spec,
                )  # fmt: skip
            start += n
        return y_TD, _LoopCtx(x_TD, w1_EHD, b1_EH, w2_EDF, b2_ED, counts, probs_T, spec)

    def backward(self, ctx: Any, dy_TD: Tensor) -> tuple[OptTensor, ...]:
        """See the module docstring."""
        if not isinstance(ctx, _LoopCtx):
            from trainer.moe import quantized_mlp

            return quantized_mlp.backward(ctx, dy_TD)
        grads = [
            torch.zeros_like(t) if t is not None else None
            for t in (ctx.x_TD, ctx.w1_EHD, ctx.b1_EH, ctx.w2_EDF, ctx.b2_ED, ctx.probs_T)
        ]
        start = 0
        for e, n in enumerate(ctx.counts):
            if not n:
                start += n
                continue
            sl = slice(start, start + n)
            leaves = [
                ctx.x_TD[sl], ctx.w1_EHD[e], None if ctx.b1_EH is None else ctx.b1_EH[e], ctx.w2_EDF[e],
                None if ctx.b2_ED is None else ctx.b2_ED[e], None if ctx.probs_T is None else ctx.probs_T[sl],
            ]  # fmt: skip
            leaves = [None if t is None else t.detach().requires_grad_(True) for t in leaves]
            with torch.enable_grad():
                y = self._expert(*leaves, ctx.spec)
                live = [t for t in leaves if t is not None]
                got = iter(torch.autograd.grad(y, live, dy_TD[sl], allow_unused=True))
            for i, t in enumerate(leaves):
                if t is None:
                    continue
                g = next(got)
                if g is None:  # e.g. a squared_relu expert whose pre-activations are all negative
                    continue
                dst = grads[i][sl] if i in (0, 5) else grads[i][e]  # type: ignore[index]
                dst.copy_(g)
            start += n
        return tuple(grads)


# ----------------------------------------------------------------------------------------------------------
# grouped: torch._grouped_mm, eager activation, hand-written backward


@dataclass
class _GroupedCtx:
    x_TD: torch.Tensor
    h_TH: torch.Tensor  # fc1 output (+ b1), kept; the activation is recomputed from it
    w1_EHD: torch.Tensor
    b1_EH: Optional[torch.Tensor]
    w2_EDF: torch.Tensor
    b2_ED: Optional[torch.Tensor]
    tokens_per_expert_E: torch.Tensor
    offs_E: torch.Tensor
    probs_T: Optional[torch.Tensor]
    z_TD: Optional[torch.Tensor]  # fc2 output (+ b2), kept for dprobs when there are probs
    spec: ExpertSpec


def _expert_of_row(tokens_per_expert_E: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert id of every row `[T]` (for per-expert bias add); no host sync."""
    E = tokens_per_expert_E.shape[0]
    ids_E = torch.arange(E, device=tokens_per_expert_E.device)
    return torch.repeat_interleave(ids_E, tokens_per_expert_E.long(), output_size=rows)


def _segment_sum(v_TX: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """Per-expert row sums `[E, X]` (bias grads): one reduction per segment, no index_add atomics."""
    return torch.segment_reduce(v_TX, "sum", lengths=tokens_per_expert_E.long(), axis=0)


class GroupedBackend:
    """Two `torch._grouped_mm` GEMMs (fc1, fc2) with an eager activation between; hand-written backward.

    `_grouped_mm` wants int32 cumulative offsets and 16-byte-aligned strides (D and F multiples of 4 in
    fp32, 8 in bf16); rows past the last offset are left unwritten, so `tokens_per_expert_E` must sum to T.
    """

    name = "grouped"

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = device

    @staticmethod
    def _check(x_TD: torch.Tensor, w2_EDF: torch.Tensor) -> None:
        elems = 16 // x_TD.element_size()
        D, Fd = w2_EDF.shape[1], w2_EDF.shape[2]
        if D % elems or Fd % elems:
            raise MoectlError(
                f"the grouped expert backend needs hidden size ({D}) and expert ffn size ({Fd}) to be multiples "
                f"of {elems} for {x_TD.dtype} (torch._grouped_mm wants 16-byte-aligned strides)",
                "pick sizes that are multiples of 8, or set moe.backend: loop",
            )

    def forward(
        self, x_TD: Tensor, w1_EHD: Tensor, b1_EH: OptTensor, w2_EDF: Tensor, b2_ED: OptTensor,
        tokens_per_expert_E: Tensor, probs_T: OptTensor, spec: ExpertSpec,
        precision: Optional["ExpertPrecision"] = None,
    ) -> tuple[Tensor, Any]:  # fmt: skip
        """See the module docstring; with `precision`, the recipe's grouped GEMMs (quantized_mlp.py)."""
        if precision is not None:
            from trainer.moe import quantized_mlp

            return quantized_mlp.forward(
                True, x_TD, w1_EHD, b1_EH, w2_EDF, b2_ED, tokens_per_expert_E, probs_T, spec, precision
            )
        self._check(x_TD, w2_EDF)
        x_TD = x_TD.contiguous()
        offs_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
        rows_E = None
        h_TH = torch._grouped_mm(x_TD, w1_EHD.transpose(-2, -1), offs=offs_E)
        if b1_EH is not None or b2_ED is not None:
            rows_E = _expert_of_row(tokens_per_expert_E, x_TD.shape[0])
        if b1_EH is not None:
            h_TH = h_TH + b1_EH[rows_E]
        a_TF = activation(h_TH, spec)
        z_TD = torch._grouped_mm(a_TF, w2_EDF.transpose(-2, -1), offs=offs_E)
        if b2_ED is not None:
            z_TD = z_TD + b2_ED[rows_E]
        y_TD = _scale_by_probs(z_TD, probs_T)
        ctx = _GroupedCtx(
            x_TD, h_TH, w1_EHD, b1_EH, w2_EDF, b2_ED, tokens_per_expert_E, offs_E, probs_T,
            None if probs_T is None else z_TD, spec,
        )  # fmt: skip
        return y_TD, ctx

    def backward(self, ctx: Any, dy_TD: Tensor) -> tuple[OptTensor, ...]:
        """See the module docstring."""
        if not isinstance(ctx, _GroupedCtx):
            from trainer.moe import quantized_mlp

            return quantized_mlp.backward(ctx, dy_TD)
        # _grouped_mm rejects stride-0 (expanded) operands, which is what autograd hands us for y.sum().
        dy_TD = dy_TD.contiguous()
        spec, offs_E = ctx.spec, ctx.offs_E
        dz_TD, dprobs_T = _unscale_grad(dy_TD, ctx.z_TD, ctx.probs_T)
        a_TF = activation(ctx.h_TH, spec)  # recomputed: cheaper to redo than to keep [T, F] alive
        # wgrad contracts over the rows of each expert: the 2D x 2D form of _grouped_mm, groups along K
        dw2_EDF = torch._grouped_mm(dz_TD.t(), a_TF, offs=offs_E)
        da_TF = torch._grouped_mm(dz_TD, ctx.w2_EDF, offs=offs_E)
        dh_TH = activation_backward(ctx.h_TH, da_TF, spec)
        dw1_EHD = torch._grouped_mm(dh_TH.t(), ctx.x_TD, offs=offs_E)
        dx_TD = torch._grouped_mm(dh_TH, ctx.w1_EHD, offs=offs_E)
        counts_E = ctx.tokens_per_expert_E
        db1_EH = None if ctx.b1_EH is None else _segment_sum(dh_TH, counts_E).to(ctx.b1_EH.dtype)
        db2_ED = None if ctx.b2_ED is None else _segment_sum(dz_TD, counts_E).to(ctx.b2_ED.dtype)
        return dx_TD, dw1_EHD, db1_EH, dw2_EDF, db2_ED, dprobs_T


# ----------------------------------------------------------------------------------------------------------
# registry

# name -> a class/factory, or "module:attr" imported on first use (the fused backend lives in another package
# and may not exist yet; importing it lazily keeps `trainer.moe` free of Triton).
_REGISTRY: dict[str, Any] = {
    "loop": LoopBackend,
    "grouped": GroupedBackend,
    "fused": "trainer.kernels.fused_expert_mlp:FusedBackend",
}


def register_backend(name: str, target: Callable[..., ExpertBackend] | str) -> None:
    """Add or replace a backend: a class/factory (`target(device)` or `target()`), or a lazy "module:attr" path."""
    _REGISTRY[name] = target


def _resolve_auto(device: torch.device) -> str:
    """What `auto` means on `device`: `fused` on CUDA, `grouped` elsewhere.

    On an H200, fused forward+backward ran 1.24-2.0x faster than grouped and 1.07-1.56x faster than the
    eager torchtitan-style path at every default shape (docs/benchmarks.md, `moectl bench grouped-mlp`).
    On CPU the fused backend runs its pure-torch reference, which buys nothing over grouped.
    """
    return "fused" if device.type == "cuda" else "grouped"


def get_backend(name: str, device: torch.device | str | None = None) -> ExpertBackend:
    """The expert backend `name` (`auto`, `loop`, `grouped`, `fused`, ...) for tensors on `device`."""
    device = torch.device(device if device is not None else "cpu")
    if name == "auto":
        name = _resolve_auto(device)
    target = _REGISTRY.get(name)
    if target is None:
        raise MoectlError(
            f"expert backend {name!r} is not available in this build",
            f"set moe.backend to one of: auto, {', '.join(sorted(_REGISTRY))}",
        )
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is None or not module_name.startswith(e.name):
                raise  # a missing dependency inside the backend is a bug to see, not a missing backend
            raise MoectlError(
                f"expert backend {name!r} needs {module_name}, which is not in this build",
                "set moe.backend: grouped (or auto)",
            ) from e
        target = getattr(module, attr)
    try:
        takes_device = len(inspect.signature(target).parameters) > 0
    except (TypeError, ValueError):  # a builtin without a signature: assume the plain form
        takes_device = False
    return target(device) if takes_device else target()
