"""`train.compile`: regional `torch.compile` of the small, fusible parts of every decoder layer.

`regional` compiles, in every decoder layer, the two RMSNorms (with the residual add before each, where there
is one), the attention between its projections (`SelfAttention.attend`: head split, QK norm, RoPE, scaled
dot-product attention) and the MoE router's routing (`TopKRouter.route`: fp32 scores, top-k, aux losses);
and the model's final norm and cross-entropy (`GPTMoE.lm_loss`).
This is torchtitan's per-block regional compile minus what moectl runs itself: the linear projections (plain
GEMMs, or the precision recipe's quantized ones), the router's logits GEMM (`moe/router_gemm.py`), the
dispatcher and the expert MLP (the configured backend's kernels) stay eager.

Why regions and not the whole model: the distributed wrapper (`trainer.distributed`) installs forward
pre-hooks on modules (lazy param gather) and grad hooks on params, and the expert and low-precision paths
are autograd Functions with Triton kernels and host-side state. Compiling each region's `forward` (not the
module's `__call__`) keeps every module hook eager and outside the graphs, and no compiled region calls a
submodule. The graphs take params as inputs, so one graph per region kind serves every layer.

`MOECTL_COMPILE_BACKEND` picks the torch.compile backend (default `inductor`); the CPU tests use
`aot_eager` (Dynamo + AOTAutograd without code generation), because inductor's C++ build of even a tiny
graph takes about 20 s on a cold 2-core CPU.
"""

from __future__ import annotations

import difflib
import os
import warnings
from typing import Any, Callable, Literal

import torch
from torch import nn

from moectl.core.errors import UsageError

CompileChoice = Literal["none", "regional", "auto"]
BACKEND_ENV = "MOECTL_COMPILE_BACKEND"
#: Inductor's note to PyTorch's developers when it lowers the cross-entropy's softmax over the vocabulary as a
#: split reduction: three "warning:" lines on every GPU run (device tool, torch 2.11), nothing a user can act on.
INDUCTOR_NOTES = (r"\s*Online softmax is disabled on the fly",)


def wants_compile(choice: CompileChoice, device: torch.device) -> bool:
    """Whether `train.compile=choice` compiles on `device`: `auto` is regional on CUDA, none elsewhere."""
    if choice == "auto":
        return device.type == "cuda"
    return choice == "regional"


def compile_backend() -> str:
    """The torch.compile backend: `$MOECTL_COMPILE_BACKEND`, else inductor.

    A name torch.compile does not know is the user's to fix: a `UsageError` naming the variable (one line, exit
    2), where torch raised `InvalidBackend` from inside the first `torch.compile` call, a traceback. Only a name
    set in the environment is looked up (listing the backends imports them all: about a second).
    """
    name = os.environ.get(BACKEND_ENV)
    if not name:
        return "inductor"
    known = torch.compiler.list_backends(exclude_tags=())
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]}? Otherwise " if close else ""
        raise UsageError(f"environment variable {BACKEND_ENV}={name!r} is not a torch.compile backend",
                         f"{hint}set it to one of torch.compiler.list_backends() (inductor, aot_eager, eager, ...), "
                         "or unset it for inductor")  # fmt: skip
    return name


def _compile_method(module: nn.Module, method: str, **compile_kwargs: Any) -> None:
    """Replace `module.<method>` by a compiled bound method (an instance attribute; the class is untouched)."""
    bound: Callable[..., Any] = getattr(module, method)
    setattr(module, method, torch.compile(bound, **compile_kwargs))


def compile_regions(model: nn.Module, *, backend: str | None = None, deterministic: bool = False) -> list[str]:
    """Compile the norms, attention core and router of every decoder layer of `model` in place.

    Returns the compiled regions' module paths (e.g. `decoder.layers.0.self_attention.attend`). Parameters,
    state-dict keys and hooks are untouched; only the listed methods become compiled callables. Calling
    it twice on one model is refused (a region must not be compiled inside a compiled region).
    `deterministic` (`train.deterministic`) puts inductor in its deterministic mode: it otherwise picks
    some kernel configurations by timing them, and two of them may sum in different orders.
    """
    from trainer.moe import MoELayer

    if getattr(model, "_moectl_compiled_regions", None):
        raise RuntimeError("compile_regions was already applied to this model")
    for note in INDUCTOR_NOTES:
        warnings.filterwarnings("ignore", message=note, category=UserWarning)
    kwargs: dict[str, Any] = {"backend": backend or compile_backend()}
    if deterministic and kwargs["backend"] == "inductor":  # options are inductor's config
        kwargs["options"] = {"deterministic": True}
    done: list[str] = []
    for i, layer in enumerate(model.decoder.layers):  # type: ignore[union-attr]
        prefix = f"decoder.layers.{i}"
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            _compile_method(getattr(layer, name), "forward", **kwargs)
            done.append(f"{prefix}.{name}.forward")
        _compile_method(layer.self_attention, "attend", **kwargs)
        done.append(f"{prefix}.self_attention.attend")
        if isinstance(layer.mlp, MoELayer):
            _compile_method(layer.mlp.router, "route", **kwargs)  # the logits' GEMM stays eager (router_gemm.py)
            done.append(f"{prefix}.mlp.router.route")
    # the final norm (with the last layer's residual add): eagerly its backward alone was ~15 launches and
    # ~0.6 ms per micro-batch of fp32 elementwise passes on the reference model
    _compile_method(model.decoder.final_layernorm, "forward", **kwargs)  # type: ignore[union-attr]
    done.append("decoder.final_layernorm.forward")
    _compile_method(model, "lm_loss", **kwargs)
    done.append("lm_loss")
    model._moectl_compiled_regions = done  # type: ignore[assignment]
    return done
