"""`quantize`: a high-precision tensor -> a QuantizedTensor under one scheme (the recipes' entry point).

One call quantizes a whole tensor, including a grouped `[E, out, in]` weight (scales per expert or per
tile inside an expert, never across experts), and a grouped activation `[T, K]` with its token groups
(`offsets`), so the optimizer's post-step quantize of a single grouped weight is one op, not a loop.
"""

from __future__ import annotations

from typing import Optional

import torch

from .blocks import transposed
from .groups import Jagged, TokenGroups
from .kinds import KIND_MODULES
from .quantized_tensor import QuantizedTensor
from .scheme import Scheme


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
