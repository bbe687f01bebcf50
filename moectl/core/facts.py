"""Facts several layers share, stated once: the expert activations, the fc1 gate/up row layout, the token
alignment each low-precision recipe needs, the files a Megatron data prefix names, and what the device-dependent defaults (`moe.backend: auto`,
`parallel.gradient_accumulation_fusion: null`) resolve to. Torch-free, so the rule catalogue, the parameter
counter, the checkpoint format, the engine's math and the kernels all read the same values."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, get_args

# --- expert activations ------------------------------------------------------------------------------
Activation = Literal["swiglu", "quick_geglu", "squared_relu"]
ACTIVATIONS: tuple[str, ...] = get_args(Activation)
# Gated activations read a gate and an up half from fc1, whose output is then 2F wide (H = 2F).
GATED_ACTIVATIONS: tuple[str, ...] = ("swiglu", "quick_geglu")
QUICK_GELU_ALPHA = 1.702  # quick_gelu(x) = x * sigmoid(1.702 x), as in CLIP and TE's ScaledClampedQGeGLU


def expert_capacity(capacity_factor: float, num_tokens: int, topk: int, num_experts: int) -> int:
    """Routings an expert may take under a capacity: ceil(factor * T*K / E), at most T (the dispatchers drop
    the rest; the rules size what depends on it).

    T bounds it because a token's K experts are distinct: no expert gets more than T routings, so a capacity
    of T already drops nothing and a larger one would only pad more zero rows of prob 0, which change no
    output or grad (factors from E/K up train bitwise alike). Megatron's router likewise keeps every routing
    once the capacity passes T, but its get_capacity is unbounded: a finite factor such as 1e308 overflows
    to inf there, as it did here. Bounded, every finite factor > 0 is a count of rows.
    """
    capacity = capacity_factor * num_tokens * topk / num_experts  # may be inf: compared, never converted
    return num_tokens if capacity >= num_tokens else math.ceil(capacity)


def megatron_prefix_paths(path: str) -> tuple[str, str]:
    """`(bin_path, idx_path)` for a Megatron data prefix, or for a path that already ends in `.bin`/`.idx`: what
    the loader reads (trainer/data/sources/megatron.py) and the data rule checks (MOE045)."""
    for ext in (".bin", ".idx"):
        if path.endswith(ext):
            path = path[: -len(ext)]
    return path + ".bin", path + ".idx"


def check_activation(activation: str) -> None:
    """Raise ValueError for an activation nothing implements."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}; expected one of {ACTIVATIONS}")


def is_gated(activation: str) -> bool:
    """True for activations that read a gate and an up half (H == 2F)."""
    check_activation(activation)
    return activation in GATED_ACTIVATIONS


def fc1_rows(activation: str, ffn_size: int) -> int:
    """H, the rows of an expert's fc1 weight: 2F for a gated activation, else F."""
    return 2 * ffn_size if is_gated(activation) else ffn_size


def ffn_width(h_width: int, activation: str, interleave: Optional[int]) -> int:
    """F from H, checking that a gated H is even and that the interleave block divides F."""
    gated = is_gated(activation)
    if gated and h_width % 2:
        raise ValueError(f"gated activation {activation!r} needs an even fc1 width, got {h_width}")
    f = h_width // 2 if gated else h_width
    if gated and interleave is not None and (interleave <= 0 or f % interleave):
        raise ValueError(f"glu_interleave_size={interleave} must be positive and divide the ffn width {f}")
    return f


# --- the fc1 gate/up row layout ----------------------------------------------------------------------
# fc1's 2F rows are `[gate; up]` (row h*F + f: h = 0 gate, 1 up), or with interleave I blocks
# `[g(I), u(I), g(I), u(I), ...]` (row b*2I + h*I + o holds f = b*I + o). The engine reads either layout
# through views (trainer/moe/expert_math.py), the Triton kernel through the same index arithmetic, and the
# checkpoint format moves rows between layouts with the permutation below.
def fc1_row_order(from_interleave: Optional[int], to_interleave: Optional[int], ffn_size: int) -> list[int]:
    """The source row of every target row of fc1 when moving from one layout to another (None = `[gate; up]`)."""
    F = ffn_size
    order = []
    for j in range(2 * F):
        if to_interleave is None:
            h, f = divmod(j, F)
        else:
            i = to_interleave
            h, f = (j % (2 * i)) // i, (j // (2 * i)) * i + j % i
        if from_interleave is None:
            order.append(h * F + f)
        else:
            i = from_interleave
            order.append((f // i) * (2 * i) + h * i + f % i)
    return order


#: the attribute a gated fc1 weight parameter carries (a `GluRows`), set where the model builds it (the
#: experts' fc1 in both layouts, the dense MLP's fc1) and read by what treats gate and up as two linear maps
#: (Muon with `optimizer.muon_split_glu`, trainer/optim/muon_routing.py)
GLU_ROWS_ATTR = "glu_rows"


@dataclass(frozen=True)
class GluRows:
    """How the `2F` rows of a gated fc1 weight `[..., 2F, in]` hold its gate and up maps: `[gate; up]`
    (`interleave` None), or blocks `[g(I), u(I), ...]` of `interleave` rows (the layout above)."""

    interleave: Optional[int] = None


#: the attribute a fused QKV weight parameter carries (a `QkvRows`), set where attention builds it and read by
#: what treats its query, key and value rows as three linear maps (Muon with `optimizer.muon_split_qkv`)
QKV_ROWS_ATTR = "qkv_rows"


@dataclass(frozen=True)
class QkvRows:
    """How the rows of a fused QKV weight `[G * (q + 2 kv), in]` hold its three maps, Megatron-Core's layout:
    per query group (G of them) `q` query rows (the group's heads times the head dim), then `kv` key rows, then
    `kv` value rows."""

    groups: int
    q: int
    kv: int

    @property
    def parts(self) -> tuple[tuple[int, int], ...]:
        """The (first row, end row) of the query, key and value rows inside one group's block."""
        return (0, self.q), (self.q, self.q + self.kv), (self.q + self.kv, self.q + 2 * self.kv)

    @property
    def group_rows(self) -> int:
        """Rows per query group: `q + 2 kv`."""
        return self.q + 2 * self.kv


# --- device-dependent defaults ------------------------------------------------------------------------
# `device_kind` is "cuda" or "cpu" (a torch.device's `type`; the rules pass what `train.device` says).


def resolved_expert_backend(backend: str, device_kind: str) -> str:
    """What `moe.backend` runs on a device of `device_kind`: `auto` is `fused` on CUDA, `grouped` elsewhere.

    On an H200, fused forward+backward ran 1.24-2.0x faster than grouped and 1.07-1.56x faster than the eager
    torchtitan-style path at every default shape (docs/benchmarks.md, `moectl bench grouped-mlp`). On CPU the
    fused backend runs its pure-torch reference, which buys nothing over grouped.
    """
    if backend != "auto":
        return backend
    return "fused" if device_kind == "cuda" else "grouped"


def fuses_wgrad(fusion: Optional[bool], optimizer: str, device_kind: str) -> bool:
    """Whether weight grads accumulate into fp32 `main_grad` inside the GEMMs (`fusion` is
    `parallel.gradient_accumulation_fusion`; null = on CUDA, under any optimizer but SGD, whose engine has no
    grad buffers and so no `main_grad`).

    On an H100 (reference model, bf16) it took the step from 317 to 295 ms: the 30 ms of bf16-grad adds go,
    and the experts' Triton wgrad costs 10 ms more than the grouped GEMM it replaces (docs/benchmarks.md).
    """
    if fusion is not None:
        return fusion
    return device_kind == "cuda" and optimizer != "sgd"


# --- low-precision recipes ---------------------------------------------------------------------------
# Rows per expert token group must be a multiple of this (each recipe's `align_size`), and so must every
# GEMM dimension the recipe quantizes in blocks along, so every scaling block is whole: the fp8 grouped
# GEMM's 16-row groups (Megatron and torchao: 16), blockwise's 128x128 / 1x128 blocks, the 1x32 blocks of
# MXFP8, and NVFP4's 32 (its 16-element blocks, at the FP4 GEMM's K granularity, as Megatron pads).
RECIPE_ALIGN: dict[str, int] = {"tensorwise": 16, "delayed": 16, "rowwise": 16, "blockwise": 128, "mxfp8": 32,
                                "nvfp4": 32}
