"""Expert MLP backends: the kernels behind `GroupedMLP`, over plain tensors in the `[E, out, in]` layout.

This module is the protocol and the registry; each backend is a module beside it.

The contract: every backend is an object with

    forward(x_TD, w1_EHD, b1_EH, w2_EDF, b2_ED, tokens_per_expert_E, probs_T, spec) -> (y_TD, ctx)
    backward(ctx, dy_TD) -> (dx_TD, dw1_EHD, db1_EH, dw2_EDF, db2_ED, dprobs_T)

and, to delay the weight grads (`moe.delay_wgrad_compute`, `trainer/moe/delayed_wgrad.py`),

    backward_dgrad(ctx, dy_TD) -> (dx_TD, dprobs_T, wgrad)      wgrad() -> (dw1_EHD, db1_EH, dw2_EDF, db2_ED)

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
(`trainer/moe/expert_precision.py`): fc1 and fc2 then run through the recipe's quantized (grouped) GEMMs, weight grads
come back fp32, and every expert segment must be a multiple of `recipe.align_size` rows. `loop`, `grouped`
and `fused` have one; `te` has one for the fp8 tensorwise recipe only (MOE062); `GroupedMLP` refuses a
recipe for a backend without (`supports_precision`).

Dtypes: weights and x share one dtype; probs may be fp32 (the router's). Prob scaling and dprobs are
computed in fp32 and the output is cast back to x's dtype, so bf16 runs do not round the probs.

Backends by name (`get_backend`): `loop` (reference, `loop.py`), `grouped` (torch._grouped_mm, `grouped.py`),
`fused` (grouped GEMMs around one fused activation kernel, `fused.py`, imported on first use), `te`
(Transformer Engine's grouped GEMMs and row-scaled activation kernel, `te.py`: CUDA only, TE imported when
the backend is built, never at package import), `auto` (-> `fused` on CUDA, else `grouped`; see
`moectl/core/facts.py resolved_expert_backend`). The math they share is `trainer/moe/expert_math.py`;
`quantized.py` is the loop and grouped backends under a low-precision recipe.
A registry target is a class or factory; it is called as `target(device)` when it takes an argument, else as
`target()`, and must return an object with `name`, `forward`, `backward`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch

from moectl.core.errors import MoectlError
from moectl.core.facts import resolved_expert_backend
from trainer.moe.expert_math import ExpertSpec

if TYPE_CHECKING:
    from trainer.moe.expert_precision import ExpertPrecision  # noqa: F401


#: What `backward_dgrad` hands back for later: computes `(dw1_EHD, db1_EH, dw2_EDF, db2_ED)` when called.
WgradFn = Callable[[], tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]]


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

    def backward_dgrad(self, ctx: Any, dy_TD: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor], WgradFn]:
        """Optional (`moe.delay_wgrad_compute`): `(dx, dprobs, wgrad)`, the weight and bias grads deferred to
        `wgrad()`, bitwise what `backward` returns."""
        ...


def supports_delayed_wgrad(backend: ExpertBackend) -> bool:
    """Whether `backend` can hand its weight grads back for later (`backward_dgrad`)."""
    return callable(getattr(backend, "backward_dgrad", None))


def _takes(method: Any, keyword: str) -> bool:
    """Whether `method` takes `keyword`, asked once per function (the backward's capability checks run on every
    expert layer's backward, and `inspect.signature` costs tens of microseconds of host time each)."""
    return _function_takes(getattr(method, "__func__", method), keyword)


@functools.lru_cache(maxsize=None)
def _function_takes(function: Any, keyword: str) -> bool:
    try:
        return keyword in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def supports_wgrad_into(backend: ExpertBackend) -> bool:
    """Whether `backend.backward` can add weight grads into fp32 targets itself (the keyword `wgrad_into`:
    gradient-accumulation fusion, so no bf16 grad is written and then added)."""
    return _takes(backend.backward, "wgrad_into")


def supports_recipe_wgrad_into(backend: ExpertBackend) -> bool:
    """Whether `backend` takes `wgrad_into` under a low-precision recipe too (the class attribute
    `recipe_wgrad_into`): `fused` does; `te` adds only its high-precision grads itself."""
    return supports_wgrad_into(backend) and bool(getattr(backend, "recipe_wgrad_into", False))


def overwrites_stale_wgrad(backend: ExpertBackend) -> bool:
    """Whether `backend` overwrites weight-grad targets flagged stale (the keyword `wgrad_stale` beside
    `wgrad_into`, high precision; trainer/main_grad.py), so zero_grad may skip filling them: `fused` does."""
    return _takes(backend.backward, "wgrad_stale") and supports_wgrad_into(backend)


def leaves_wgrad_sq(backend: ExpertBackend) -> bool:
    """Whether `backend.backward` can leave the partial sums of squares of the weight grads it added (the
    keyword `wgrad_sq` beside `wgrad_into`, high precision; trainer/grad_sq.py): `fused` does."""
    return _takes(backend.backward, "wgrad_sq") and supports_wgrad_into(backend)


def defers_wgrad(backend: ExpertBackend) -> bool:
    """Whether `backend.backward` can keep a micro-batch's wgrad operands for the step's last one (the keywords
    `wgrad_stash` and `wgrad_defer` beside `wgrad_into`, high precision; trainer/moe/wgrad_deferral.py)."""
    return _takes(backend.backward, "wgrad_stash") and supports_wgrad_into(backend)


def supports_precision(backend: ExpertBackend) -> bool:
    """Whether `backend.forward` takes a low-precision recipe (the keyword `precision`)."""
    return _takes(backend.forward, "precision")


# ----------------------------------------------------------------------------------------------------------
# registry

# name -> a class/factory, or "module:attr" imported on first use (a backend registered from outside may not
# be importable everywhere).
_REGISTRY: dict[str, Any] = {
    "loop": "trainer.moe.backends.loop:LoopBackend",
    "grouped": "trainer.moe.backends.grouped:GroupedBackend",
    "fused": "trainer.moe.backends.fused:FusedBackend",
    "te": "trainer.moe.backends.te:TEBackend",
}


def register_backend(name: str, target: Callable[..., ExpertBackend] | str) -> None:
    """Add or replace a backend: a class/factory (`target(device)` or `target()`), or a lazy "module:attr" path."""
    _REGISTRY[name] = target


def get_backend(name: str, device: torch.device | str | None = None) -> ExpertBackend:
    """The expert backend `name` (`auto`, `loop`, `grouped`, `fused`, ...) for tensors on `device`."""
    device = torch.device(device if device is not None else "cpu")
    if name == "auto":
        name = resolved_expert_backend(name, device.type)
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
