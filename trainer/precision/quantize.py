"""`quantize`: a high-precision tensor -> a QuantizedTensor under one scheme (the recipes' entry point).

One call quantizes a whole tensor, including a grouped `[E, out, in]` weight (scales per expert or per
tile inside an expert, never across experts), and a grouped activation `[T, K]` with its token groups
(`offsets`), so the optimizer's post-step quantize of a single grouped weight is one op, not a loop.

Fast path: per-tensor fp8 (the `tensor` kind: recipes `tensorwise` and `delayed`) on a CUDA tensor, with
Triton importable, runs the fused kernels of `trainer/kernels/fp8_quant_triton.py`: one amax pass and one
pass that writes the rowwise and the columnwise copy together, reading x in its own dtype (no fp32 copy, no
separate transpose). It produces exactly the QuantizedTensor of the eager path below (same bytes, scales
and groups; tested bitwise on GPU). The eager path stays the reference, and runs everywhere else (CPU,
the other kinds). MXFP8 (the mx kind, 1x32 blocks) has a one-pass kernel of its own
(`trainer/kernels/mxfp8_quant_triton.py`), bitwise equal to kinds/mx.py. `MOECTL_TRITON_QUANTIZE=0` turns both
fast paths off (comparisons, bisecting).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from trainer.kernels import has_triton
from trainer.switches import switched_off

from .blocks import transposed
from .formats import fp8_format
from .groups import Jagged, TokenGroups
from .kinds import KIND_MODULES
from .kinds.per_tensor import tensor_amax
from .qdata import QuantizedData
from .quantized_tensor import QuantizedTensor
from .scheme import Scheme

TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def triton_fast_path(x: torch.Tensor, scheme: Scheme) -> bool:
    """Whether `quantize(x, scheme)` runs the fused Triton kernels: per-tensor fp8 of a bf16/fp16/fp32 CUDA
    tensor, Triton present, and not switched off by `MOECTL_TRITON_QUANTIZE=0`."""
    return scheme.kind == "tensor" and _triton_ok(x)


def _triton_ok(x: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dtype in TRITON_DTYPES
        and x.numel() > 0
        and not switched_off("MOECTL_TRITON_QUANTIZE")
        and has_triton()
    )


def mx_triton_fast_path(x: torch.Tensor, scheme: Scheme) -> bool:
    """Whether `quantize(x, scheme)` runs the one-pass Triton MXFP8 kernel (trainer/kernels/mxfp8_quant_triton.py):
    the mx kind with 1x32 blocks on a bf16/fp16/fp32 CUDA tensor, under the same switches as `triton_fast_path`."""
    return scheme.kind == "mx" and scheme.block == (1, 32) and _triton_ok(x)


def quantize(
    x: torch.Tensor,
    scheme: Scheme,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    offsets: Optional[torch.Tensor] = None,
    groups: Optional[TokenGroups] = None,
    amax: Optional[torch.Tensor] = None,
    encode_scale: Optional[torch.Tensor] = None,
    recipe: str = "",
) -> QuantizedTensor:
    """Quantize `x` `[..., M, K]` (any float dtype; not differentiated through).

    rowwise / columnwise: which copies to make (see quantized_tensor.py).
    offsets:  cumulative end rows of token groups of a 2-D grouped activation `[T, K]` (or pass `groups`).
    amax:     per-tensor amax override (tensor and nvfp4 kinds): shape `x.shape[:-2]`, or `[G]` with groups.
              This is how a sharded param is quantized with an amax all-reduced over its ranks.
    encode_scale: per-tensor encode scale override (tensor kind; delayed scaling).
    """
    if not (rowwise or columnwise):
        raise ValueError("ask for at least one of rowwise / columnwise")
    if x.dim() < 2:
        raise ValueError(f"quantize needs a tensor of at least 2 dims, got shape {tuple(x.shape)}")
    if groups is None and offsets is not None:
        if x.dim() != 2:
            raise ValueError("token-group offsets apply to 2-D [T, K] activations")
        groups = TokenGroups.from_offsets(offsets, x.shape[0], validate=x.device.type == "cpu")
    kind = KIND_MODULES[scheme.kind]
    if triton_fast_path(x, scheme):  # the tensor kind: never packed or blocked, so no checks below apply
        # before the fp32 copy below: the kernels read x in its own dtype (that copy alone cost 1.2 ms of a
        # 5.6 ms fp8 expert MLP step on an H200)
        fast = _quantize_per_tensor_triton(x, scheme, groups, rowwise, columnwise, amax, encode_scale, recipe, False)
        if fast is not None:
            return fast[0]
    if mx_triton_fast_path(x, scheme):
        if groups is not None and columnwise:
            groups.check_aligned(scheme.block[1], scheme.describe())  # as the eager path below
        return _quantize_mx_triton(x, scheme, groups, rowwise, columnwise, recipe)
    hp = x.detach().to(torch.float32).contiguous()
    if scheme.packed:
        for dim, which in ((-1, "rowwise"), (-2, "columnwise")):
            if (which == "rowwise" and rowwise or which == "columnwise" and columnwise) and hp.shape[dim] % 2:
                raise ValueError(f"e2m1 packs two values per byte: the {which} copy needs an even dim, got {tuple(hp.shape)}")
    if groups is not None and scheme.blocked:
        if rowwise and scheme.block[0] > 1:
            raise ValueError(f"{scheme.describe()}: 2-D tiles cannot be used on the token rows of a grouped activation")
        if columnwise:
            groups.check_aligned(scheme.block[1], scheme.describe())

    overrides = {"amax": amax, "encode_scale": encode_scale}
    row = col = None
    if rowwise:
        row = kind.quantize(hp, scheme, Jagged(groups, -2) if groups else None, **overrides)
    if columnwise:
        if row is not None and scheme.transposable:
            col = kind.transpose(row, scheme)
        else:
            col = kind.quantize(
                transposed(hp), scheme, Jagged(groups, -1) if groups else None, **overrides
            )
    return QuantizedTensor(
        scheme=scheme, shape=x.shape, dtype=x.dtype, rowwise=row, columnwise=col, groups=groups, recipe=recipe
    )


def quantize_with_amax(
    x: torch.Tensor,
    scheme: Scheme,
    *,
    encode_scale: torch.Tensor,
    rowwise: bool = True,
    columnwise: bool = False,
    groups: Optional[TokenGroups] = None,
    recipe: str = "",
) -> tuple[QuantizedTensor, torch.Tensor]:
    """Quantize `x` with a given per-tensor `encode_scale` (delayed scaling) and return its own amax too:
    `[...]` = `x.shape[:-2]`, or `[G]` per token group (what `kinds.per_tensor.tensor_amax` gives).

    On the Triton fast path the amax is taken in the same pass that writes the fp8 copies (the scale does
    not depend on it); elsewhere it is one eager reduction over the fp32 values."""
    if scheme.kind != "tensor":
        raise ValueError(f"quantize_with_amax is for per-tensor scaling, not {scheme.describe()}")
    if triton_fast_path(x, scheme) and x.dim() >= 2:
        fast = _quantize_per_tensor_triton(x, scheme, groups, rowwise, columnwise, None, encode_scale, recipe, True)
        if fast is not None:
            return fast[0], fast[1]  # type: ignore[return-value]
    amax = tensor_amax(x.detach().to(torch.float32), Jagged(groups, -2) if groups is not None else None)
    q = quantize(
        x, scheme, rowwise=rowwise, columnwise=columnwise, groups=groups, encode_scale=encode_scale, recipe=recipe
    )
    return q, amax


def _quantize_per_tensor_triton(
    x: torch.Tensor,
    scheme: Scheme,
    groups: Optional[TokenGroups],
    rowwise: bool,
    columnwise: bool,
    amax: Optional[torch.Tensor],
    encode_scale: Optional[torch.Tensor],
    recipe: str,
    want_amax: bool,
) -> Optional[tuple[QuantizedTensor, Optional[torch.Tensor]]]:
    """The fused-kernel version of the `tensor` kind (see the module docstring), or None where the eager path
    must decide (an amax / encode-scale override whose shape is not the per-tensor shape: the eager path
    broadcasts it, and keeps that shape for the stored scale)."""
    from trainer.kernels import fp8_quant_triton as tq  # lazy: needs Triton, CUDA only

    fmt = fp8_format(scheme.fmt)
    M, K = x.shape[-2], x.shape[-1]
    per_shape = (groups.count,) if groups is not None else tuple(x.shape[:-2])
    for given in (amax, encode_scale):
        if given is not None and tuple(given.shape) != per_shape:
            return None
    n = math.prod(per_shape)
    x_BMK = x.detach().contiguous().view(-1, M, K)  # in x's own dtype: no fp32 copy
    ids = groups.ids if groups is not None else None
    measured: Optional[torch.Tensor] = None
    amax_bits: Optional[torch.Tensor] = None
    if encode_scale is None and amax is None:
        amax = measured = tq.amax(x_BMK, ids, n)
    if encode_scale is not None and want_amax:
        amax_bits = torch.zeros(n, dtype=torch.int32, device=x.device)
    q = tq.quantize(
        x_BMK, fmt.dtype, fmt.max, amax=amax if encode_scale is None else None, encode=encode_scale,
        pow2=scheme.pow2, ids_T=ids, num_groups=n, rowwise=rowwise, columnwise=columnwise, amax_out=amax_bits,
        gemm_scales=True,  # a token-grouped copy also gets its scales as the native grouped GEMM reads them
    )  # fmt: skip
    if amax_bits is not None:
        measured = amax_bits.view(torch.float32)
    if want_amax and measured is None:  # an amax override was given: measure x's own for the caller
        measured = tq.amax(x_BMK, ids, n)
    dec = q.decode.view(per_shape)
    col_shape = (*x.shape[:-2], K, M)
    row = QuantizedData(data=q.row.view(x.shape), scale=dec, gemm_scale=q.decode_rows) if q.row is not None else None
    col = None
    if q.col is not None:  # the eager columnwise copy of a weight keeps a scale tensor of its own (a clone);
        # a token-grouped activation or grad is transient and never written in place: its copies share one
        own = row is not None and groups is None
        col = QuantizedData(data=q.col.view(col_shape), scale=dec.clone() if own else dec, gemm_scale=q.decode_cols)
    qt = QuantizedTensor(
        scheme=scheme, shape=x.shape, dtype=x.dtype, rowwise=row, columnwise=col, groups=groups, recipe=recipe
    )
    return qt, (measured.view(per_shape) if measured is not None else None)


def _quantize_mx_triton(
    x: torch.Tensor, scheme: Scheme, groups: Optional[TokenGroups], rowwise: bool, columnwise: bool, recipe: str
) -> QuantizedTensor:
    """The one-pass Triton version of the mx kind (both copies from one read of x, in x's own dtype)."""
    from trainer.kernels import mxfp8_quant_triton as mxq  # lazy: needs Triton, CUDA only

    fmt = fp8_format(scheme.fmt)
    M, K = x.shape[-2], x.shape[-1]
    x_BMK = x.detach().contiguous().view(-1, M, K)
    q = mxq.quantize(
        x_BMK, fmt.dtype, fmt.max, fmt.emax, rounding=scheme.mx_rounding, rowwise=rowwise, columnwise=columnwise
    )
    lead = x.shape[:-2]
    row = col = None
    if q.row is not None and q.row_scale is not None:
        row = QuantizedData(data=q.row.view(x.shape), scale=q.row_scale.view(*lead, M, -1))
    if q.col is not None and q.col_scale is not None:
        col = QuantizedData(data=q.col.view(*lead, K, M), scale=q.col_scale.view(*lead, K, -1))
    return QuantizedTensor(
        scheme=scheme, shape=x.shape, dtype=x.dtype, rowwise=row, columnwise=col, groups=groups, recipe=recipe
    )
