"""Muon: momentum orthogonalised by a Newton-Schulz iteration, on fp32 masters.

Formulas, and where they come from:

- `newton_schulz` is Keller Jordan's quintic iteration ("Muon: An optimizer for hidden layers in neural
  networks", kellerjordan.github.io/posts/muon, `zeropower_via_newtonschulz5`): normalise by the
  Frobenius norm (+1e-7) so every singular value is at most 1, work on the wide orientation (transpose
  when rows > cols, so `X @ X.mT` is the smaller Gram matrix), then `steps` times
  `A = X X^T; B = b A + c A A; X = a X + B X` with (a, b, c) = (3.4445, -4.7750, 2.0315). These
  coefficients trade exactness for speed: singular values end in roughly [0.7, 1.2], not at 1.
- the update follows Keller Jordan's `muon_update` (github.com/KellerJordan/Muon): the momentum buffer is
  an EMA, `buf.lerp_(g, 1 - mu)`, Nesterov takes `lerp(g, buf, mu)`, plain momentum takes `buf`. (The
  Moonlight code keeps `buf = mu buf + g`; that differs from the EMA by the factor 1 - mu only, which
  the Frobenius normalisation removes up to its 1e-7.)
- the shape scale is Moonlight's (Liu et al., "Muon is Scalable for LLM Training", arXiv:2502.16982,
  `adjust_lr_for_muon` in its code): the orthogonalised update is multiplied by
  `0.2 * sqrt(max(out, in))`, giving it the RMS of a typical AdamW update (~0.2). Chosen over Keller
  Jordan's `max(1, out/in) ** 0.5` because moectl has one `optimizer.lr` and one `weight_decay` for both
  optimizers of a Muon run (Muon for the matrices, AdamW for the rest), and Moonlight's scale is the one
  that lets both use AdamW's values.
- decoupled weight decay `p *= 1 - lr * wd` before the update (both references), with the unscaled lr.

Compute dtype (`optimizer.muon_compute_dtype`, resolved by `resolve_compute_dtype`): `auto` runs the
iteration in bf16 on a CUDA device with bf16 tensor cores (Keller Jordan's choice: the GEMMs run at bf16
tensor-core speed, the update is still applied to fp32 masters) and in fp32 elsewhere. The fp32 iteration is
the reference formula above operation for operation (tested bitwise against it). The bf16 iteration fuses
each step into three batched GEMMs, `A = X X^T`, `B = baddbmm(A, A, A, beta=b, alpha=c)`,
`X = baddbmm(X, B, X, beta=a)`: the GEMMs accumulate in fp32 and add the scaled input in fp32 before the
one rounding to bf16, where the unfused form rounds `A`, `c A`, `(c A) A`, `b A` and their sum separately
(half the error against the fp32 iteration, measured, and no elementwise kernels between the GEMMs).
A tall slice iterates from the right (`A = X^T X`, `X = a X + X B`), so every tensor stays contiguous.
On CUDA, where the slices tile, the same chain runs on Triton GEMMs instead (`kernels/ns_gemm_triton.py`:
the symmetric products computed once, the scaled inputs read in the epilogue, so nothing is copied, and
`a I` added to B before its one rounding so `B X` is a plain cuBLAS product; bf16 and fp16 alike, but for
fp16's first step, whose scale could overflow B); the cuBLAS chain below is the fallback and
`MOECTL_TRITON_NS=0` selects it.

Gram Newton-Schulz (`optimizer.muon_ns_method`, `uses_gram`): the same polynomial iterated on the `[m, m]` side,
`_iterate_gram` (after Amsel, Zhang, Chen and Dao, "Gram Newton-Schulz", 2026), restarted from a true Gram every
`GRAM_RESTART` steps, its Gram-side matrices in fp16 for a low-precision X (the driver: `muon_gram.py`). `auto`
takes it on the Triton GEMMs for slices whose long side is at least twice the short one (the reference model's
experts: their Newton-Schulz 54.0 -> 43.9 ms on an H100, docs/benchmarks.md); the fp32 iteration, the CPU's
default, stays the reference chain.

`float16` (an option, not the default): on cuBLAS, the same chain with `a` folded into B's diagonal, `X = (a I + B) X`,
one `bmm` without the input copy `baddbmm` makes of X (cuBLAS accumulates into its output, so torch first
copies the added tensor there: 16 ms of a reference-model step on an H100). In bf16 that fold doubles the
error (B is rounded, then the diagonal `a + B_ii`, up to 3.4, rounds again at 2^-7 absolute), so bf16 keeps
the copy on this path; the Triton path rounds `a I + B` once, which errs no more than the copy does. fp16 keeps 11
significant bits: its folded iteration errs about 4x less than the bf16 one against fp32 (0.003 vs 0.012
relative on random matrices, CPU) and its range suffices: after the Frobenius normalisation every entry of X,
A = X X^T and X's next value is at most ~1.2 in size and B's at most |b| + |c| < 7; only entries below
6e-5 of a slice's norm lose precision (fp16 subnormals), where bf16 keeps 8 bits.

Gated fc1 weights (`optimizer.muon_split_glu`, default on): the `2F` rows of a SwiGLU/GeGLU fc1 `[2F, in]`
are two linear maps, gate and up, stored together; split, each `[F, in]` half is orthogonalised alone and
scaled by its own Moonlight factor `0.2 * sqrt(max(F, in))`, as Megatron-Core orthogonalises the q, k and v
parts of a fused QKV weight apart (`muon_split_qkv`, on by default there, and here: `qkv_parts`, each part's
rows of every query group stacked; Megatron has no such split for fc1).
`glu_split_shape` is the shape Newton-Schulz then sees (`[*lead, 2, F, in]`: every function here reads
trailing matrices, so `ns_cost`, `ns_flops` and `muon_lr_scale` take it as is) and `glu_halves` the rows
in that order (a view; with `moe.glu_interleave_size` I a strided one that gathers the `[g(I), u(I), ...]`
blocks). The momentum, the weight decay and the update stay elementwise on the whole weight.

Batching: every function works over leading dims, so a grouped `[E, out, in]` expert weight is
orthogonalised per expert slice in one batched call, and `muon_batch` stacks same-shaped matrices of
different params into one batch. Each slice is the same math as a standalone `[out, in]` matrix (the
slices never mix: the norm is per slice, the matmuls are batched); on CPU the fp32 results are bitwise
equal (tested), which is what makes the two expert layouts train alike.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from moectl.core.facts import QkvRows
from trainer.optim.muon_gram import iterate_gram, symm_torch
from trainer.switches import switched_off

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
MOONLIGHT_RMS = 0.2
TRITON_NS_ENV = "MOECTL_TRITON_NS"
NS_METHODS = ("auto", "standard", "gram")  # `optimizer.muon_ns_method`
GRAM_RESTART = 3  # Gram Newton-Schulz steps between restarts from a true X X^T
GRAM_MIN_ASPECT = 2  # `auto`'s Gram form: long side >= this x the short one (below it saves no time)


COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The Newton-Schulz dtype of `optimizer.muon_compute_dtype` on `device`.

    `auto`: bf16 on a CUDA device with bf16 tensor cores (sm80+), else fp32 (the CPU keeps the fp32
    reference, which the bitwise dp=N == dp=1 and layout-parity guarantees are stated for).
    """
    if name == "auto":
        if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
            return torch.bfloat16
        return torch.float32
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"muon_compute_dtype must be auto, {' or '.join(COMPUTE_DTYPES)}; got {name!r}")
    return COMPUTE_DTYPES[name]


def newton_schulz(G: torch.Tensor, steps: int, compute_dtype: torch.dtype = torch.float32,
                  method: str = "standard") -> torch.Tensor:  # fmt: skip
    """Approximately orthogonalise each trailing `[m, n]` matrix of `G` (returned in `compute_dtype`).

    The result has `G`'s shape; every slice's singular vectors are `G`'s, its singular values are
    pushed towards 1 (into roughly [0.7, 1.2] after 5 steps for a well-conditioned slice). `G` is not modified.
    `method`: as `orthogonalize_` takes it.
    """
    if G.dim() < 2:
        raise ValueError(f"Newton-Schulz needs a matrix (or a batch of them), got shape {tuple(G.shape)}")
    return orthogonalize_(G.to(compute_dtype, copy=True), steps, method=method)


def orthogonalize_(X: torch.Tensor, steps: int, sumsq: Optional[torch.Tensor] = None,
                   method: str = "standard") -> torch.Tensor:  # fmt: skip
    """`newton_schulz` of `X` in its own dtype, consuming `X` (it is normalised in place; the caller owns it).

    With the standard method, fp32: the reference iteration; any other dtype: the fused baddbmm chain (see the
    module docstring), on the matrices' own orientation. `sumsq`: each slice's sum of squares, already computed
    (fp32, one per slice of a contiguous `X`, from `kernels/muon_triton.blend_` and `slice_sums`); the
    normalisation then runs as one fused kernel, or, on the Triton GEMMs, inside the first step's products
    (`ns_gemm_triton.iterate`, `muon_gram.iterate_gram`).
    `method` (`optimizer.muon_ns_method`, resolved by `uses_gram`): "gram" iterates on the Gram side
    (`_iterate_gram`), "standard" on X.
    """
    if steps < 1:
        raise ValueError(f"Newton-Schulz needs at least one step, got {steps}")
    tall = X.size(-2) > X.size(-1)
    folds = _low_precision_triton(X)
    gram = uses_gram(X, method)
    if sumsq is not None and folds:  # the Triton GEMMs take 1 / (|X| + eps) in the first step: no pass over X
        scale = sumsq.sqrt().add_(NS_EPS).reciprocal_()
        if gram:
            return _iterate_gram(X, steps, tall, scale=scale, triton=True)
        return _iterate_fused(X, steps, tall, scale)
    if sumsq is not None:
        from trainer.kernels import muon_triton

        muon_triton.normalize_(X, sumsq, NS_EPS)
    else:  # Per-slice Frobenius norm >= spectral norm, so every singular value starts in [0, 1].
        X.div_(torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).add_(NS_EPS))
    if gram:
        return _iterate_gram(X, steps, tall, triton=folds)
    if X.dtype != torch.float32:
        return _iterate_fused(X, steps, tall)
    if tall:  # iterate on the wide side: the Gram matrix X X^T is min(m, n) square
        return _iterate_reference(X.mT, steps).mT
    return _iterate_reference(X, steps)


def _iterate_reference(X: torch.Tensor, steps: int) -> torch.Tensor:
    """Keller Jordan's quintic steps, operation for operation (bitwise his fp32 result)."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + (c * A) @ A  # Keller Jordan's `b * A + c * A @ A` (left to right), the same rounding
        X = a * X + B @ X
    return X


def _iterate_fused(X: torch.Tensor, steps: int, tall: bool, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The quintic steps as three batched GEMMs each, the scaled additions in the GEMM epilogue.

    A tall `[M, m]` slice (M > m) iterates from the right, `A = X^T X`, `X = a X + X B`: the same product as
    transposing, iterating and transposing back (A and B are symmetric), with every tensor contiguous in the
    slice's own orientation, so nothing downstream reads a transposed result. `scale` (Triton path only): each
    slice's normalisation, not yet applied to X (`ns_gemm_triton.iterate`).
    """
    a, b, c = NS_COEFFICIENTS
    shape = X.shape
    X = X.reshape(-1, *shape[-2:])  # baddbmm takes one batch dim (a view for the [E, m, n] params Muon has)
    if _use_triton(X):
        from trainer.kernels import ns_gemm_triton

        return ns_gemm_triton.iterate(X, steps, NS_COEFFICIENTS, tall, scale).reshape(shape)
    assert scale is None, "only the Triton GEMMs fold the normalisation in"
    fold = X.dtype == torch.float16  # a I + B in fp16 (see the module docstring)
    for _ in range(steps):
        A = torch.bmm(X.mT, X) if tall else torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        if fold:
            B.diagonal(dim1=-2, dim2=-1).add_(a)
            X = torch.bmm(X, B) if tall else torch.bmm(B, X)
        else:
            X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
    return X.reshape(shape)


def uses_gram(X: torch.Tensor, method: str) -> bool:
    """Whether `optimizer.muon_ns_method` runs `[..., m, n]` `X` as a Gram Newton-Schulz.

    `auto`: where it is faster, a low-precision contiguous X on the Triton GEMMs (where the symmetric products
    cost about half their FLOPs) whose long side is at least `GRAM_MIN_ASPECT` times its short side: per step the
    Gram form trades the two `m x n` products of X for four symmetric `m x m` ones, which saves time from that
    aspect on (docs/benchmarks.md). The fp32 iteration stays the reference one.
    """
    if method not in NS_METHODS:
        raise ValueError(f"muon_ns_method must be one of {', '.join(NS_METHODS)}; got {method!r}")
    if method != "auto":
        return method == "gram"
    m, n = sorted(X.shape[-2:])
    return n >= GRAM_MIN_ASPECT * m and _low_precision_triton(X)


def gram_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the Gram Newton-Schulz's `[m, m]` matrices for an X of `x_dtype`: fp16 for a low-precision X
    (the normalised Gram-side matrices stay well inside fp16's range, and its 3 more significant bits than bf16
    keep the phases between restarts accurate), else X's own."""
    return torch.float16 if x_dtype in (torch.bfloat16, torch.float16) else x_dtype


def _iterate_gram(X: torch.Tensor, steps: int, tall: bool, restart: int = GRAM_RESTART,
                  scale: Optional[torch.Tensor] = None, triton: bool = False) -> torch.Tensor:  # fmt: skip
    """The quintic steps on X as a Gram Newton-Schulz (Amsel, Zhang, Chen and Dao, "Gram Newton-Schulz", 2026):
    `muon_gram.iterate_gram`, its symmetric products on Triton (`triton`: `ns_gemm_triton.symm_`) or in torch
    (`symm_torch`: each computed in fp32 and rounded once to its stored dtype, where the Triton kernels round).
    X is normalised, or `scale` holds each slice's `1 / (|X| + eps)` (as `iterate_gram` takes it).

    Why it is the same iteration: a step maps X to `q(A) X` with `A = X X^T` and `q(A) = a I + b A + c A^2`, so
    the next Gram is `q(A) A q(A) = q(A)^2 A`, again a polynomial in A, and k steps give `X_k = Q X` with Q the
    product of the k factors `q(A_i)`, all polynomials in one A that commute. So the `[m, m]` Gram side carries
    the whole iteration (`A <- q(A)^2 A`, `Q <- Q q(A)`), and X is multiplied once at the end: per step two
    `m x n` products become four `m x m` ones, all symmetric. In low precision rounding breaks the commuting and
    can turn a tiny eigenvalue of A negative, where `a^2 = 11.9` per step amplifies it; every `restart` steps the
    iteration therefore applies Q to X and starts again from a true Gram (3 measured best for 5 steps: 0.009 to
    0.015 relative error against fp32 with the Gram side in fp16, under the bf16 chain's tolerance; without
    restarts 0.11-0.21 per entry on 6-decade matrices). `a I + Z` with `Z = b A + c A^2` is never rounded as a
    whole: the products add the `a` terms in fp32, as the standard chain adds `a X`. The symmetric products run
    in fp32 here: where `auto` would not pick the Gram form, an explicit `gram` is correct but slower than the
    chain.
    """
    if triton:
        from trainer.kernels.ns_gemm_triton import symm_ as symm
    else:
        symm = symm_torch
    shape = X.shape
    X = X.reshape(-1, *shape[-2:]).contiguous()
    out = iterate_gram(X, steps, NS_COEFFICIENTS, tall, scale, gram_dtype(X.dtype), restart, symm)
    return out.reshape(shape)


def _low_precision_triton(X: torch.Tensor) -> bool:
    """Whether `orthogonalize_` runs X on the Triton GEMMs with the normalisation folded in: a low-precision,
    contiguous X whose slices `_use_triton` takes."""
    return X.dtype != torch.float32 and X.is_contiguous() and _use_triton(X)


def _use_triton(X: torch.Tensor) -> bool:
    """Whether the Triton Newton-Schulz GEMMs (`kernels/ns_gemm_triton.py`) run this `[B, m, n]` batch: on
    CUDA, where its slices tile exactly, unless `MOECTL_TRITON_NS=0` keeps cuBLAS."""
    if not X.is_cuda or switched_off(TRITON_NS_ENV):
        return False
    from trainer.kernels import ns_gemm_triton

    return ns_gemm_triton.fits(min(X.shape[-2:]), max(X.shape[-2:]))


def glu_split_shape(shape: torch.Size | tuple[int, ...]) -> torch.Size:
    """`[*lead, 2F, n]` -> `[*lead, 2, F, n]`: a gated fc1 weight as its gate and up `[F, n]` matrices."""
    *lead, rows, n = shape
    if rows % 2:
        raise ValueError(f"a gated fc1 weight has an even number of rows (gate and up), got shape {tuple(shape)}")
    return torch.Size((*lead, 2, rows // 2, n))


def glu_halves(t: torch.Tensor, interleave: Optional[int]) -> torch.Tensor:
    """The rows of a gated fc1 tensor `[*lead, 2F, n]` as `[*lead, 2, F // I, I, n]`: index 0 the gate rows,
    1 the up rows, each in feature order (I = F for `[gate; up]` rows, else the interleave block size;
    moectl/core/facts.py states the layout). A view: strided when interleaved, so reading it gathers the
    gate and the up blocks and writing it scatters them back."""
    rows = t.size(-2)
    f = rows // 2
    i = f if interleave is None else interleave
    if rows % 2 or i <= 0 or f % i:
        raise ValueError(f"gated fc1 rows {rows} do not split into gate/up blocks of {interleave}")
    return t.unflatten(-2, (f // i, 2, i)).transpose(-4, -3)


def qkv_parts(t: torch.Tensor, rows: QkvRows) -> list[torch.Tensor]:
    """The query, key and value rows of a fused QKV tensor `[G (q + 2 kv), n]` as three `[G, r, n]` views (r = q,
    kv, kv): each the part's row block of every query group, in group order. Newton-Schulz sees a part as the
    `[G r, n]` matrix these blocks stack into (`qkv_split_shapes`), as Megatron-Core splits it."""
    if t.dim() != 2 or t.size(0) != rows.groups * rows.group_rows:
        raise ValueError(f"a fused QKV weight of {rows.groups} groups of {rows.group_rows} rows, got {tuple(t.shape)}")
    blocks = t.view(rows.groups, rows.group_rows, t.size(1))
    return [blocks[:, lo:hi] for lo, hi in rows.parts]


def qkv_split_shapes(shape: torch.Size | tuple[int, ...], rows: QkvRows) -> list[torch.Size]:
    """The shapes Newton-Schulz sees for the query, key and value parts of a fused QKV weight of `shape`."""
    if len(shape) != 2 or shape[0] != rows.groups * rows.group_rows:
        raise ValueError(f"a fused QKV weight of {rows.groups} groups of {rows.group_rows} rows, got {tuple(shape)}")
    return [torch.Size((rows.groups * (hi - lo), shape[1])) for lo, hi in rows.parts]


def ns_cost(shape: torch.Size | tuple[int, ...]) -> int:
    """Newton-Schulz cost of a param (up to a constant): `max(m, n) * min(m, n)^2` per trailing matrix.

    A grouped `[E, m, n]` weight costs E matrices, a split gated fc1 (`glu_split_shape`) `[E, 2, F, n]` 2E
    of `[F, n]`. Used to balance layer-wise ownership (Megatron's LPT).
    """
    *lead, m, n = shape
    return math.prod(lead) * max(m, n) * min(m, n) ** 2


def ns_flops(shape: torch.Size | tuple[int, ...], steps: int) -> int:
    """FLOPs (2 per multiply-add) of `steps` Newton-Schulz steps on every trailing matrix of `shape`.

    Per step on the wide orientation (m = min side, n = max side): `X X^T` 2 m^2 n, `A A` 2 m^3, `B X`
    2 m^2 n. The elementwise parts are O(m n) and left out.
    """
    *lead, rows, cols = shape
    m, n = min(rows, cols), max(rows, cols)
    return math.prod(lead) * steps * (4 * m * m * n + 2 * m**3)


def muon_lr_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """Moonlight's update scale `0.2 * sqrt(max(out, in))` of the trailing `[out, in]` matrix."""
    out_features, in_features = shape[-2], shape[-1]
    return MOONLIGHT_RMS * math.sqrt(max(out_features, in_features))


@torch.no_grad()
def muon_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    weight_decay: float,
    compute_dtype: torch.dtype = torch.float32,
) -> None:
    """One Muon step in place on `param` (an fp32 master) and `momentum_buffer`; `grad` is not modified.

    `param`, `grad` and `momentum_buffer` share one shape: `[out, in]`, or `[E, out, in]` for a grouped
    expert weight (each expert slice orthogonalised alone, in one batched Newton-Schulz).
    """
    if not (param.shape == grad.shape == momentum_buffer.shape) or param.dim() < 2:
        raise ValueError(
            f"Muon steps matrices: param {tuple(param.shape)}, grad {tuple(grad.shape)}, "
            f"momentum {tuple(momentum_buffer.shape)}"
        )
    momentum_buffer.lerp_(grad, 1 - momentum)
    update = torch.lerp(grad, momentum_buffer, momentum) if nesterov else momentum_buffer
    ortho = newton_schulz(update, ns_steps, compute_dtype)
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    param.add_(ortho.to(param.dtype), alpha=-lr * muon_lr_scale(param.shape))
