"""Which params Muon steps and which AdamW steps in a Muon run (the optimizer tags of `DistributedModel`).

Muon takes the hidden matrices, as in Megatron (`megatron/core/optimizer`, `use_muon` and `dim() == 2`,
not the embedding or the output head), Keller Jordan's post and Moonlight:

- every 2-D weight: attention QKV, attention output, dense MLP, the experts' per-expert `weight{e}`, and the
  router `[E, hidden]` (a 2-D matrix like any other, as Megatron routes it);
- a grouped `[E, out, in]` expert weight: each expert slice orthogonalised alone by one batched
  Newton-Schulz. Megatron silently hands this 3-D param to Adam; here it takes the same math as the
  per-expert layout, so the two layouts train alike.

A gated fc1 weight (experts' fc1 of swiglu/quick_geglu in either layout, the dense SwiGLU MLP's fc1) carries
its gate/up row layout as the attribute `facts.GLU_ROWS_ATTR`, set where the model builds it. With
`optimizer.muon_split_glu` (default on) Muon orthogonalises its gate and up halves apart (`split_glu_rows`),
and the layer-wise plan costs it as such (`muon_model_options`), so ownership balances the work done.
Likewise an attention `linear_qkv` weight carries its per-group row layout (`facts.QKV_ROWS_ATTR`), and with
`optimizer.muon_split_qkv` (default on, as Megatron-Core's) its query, key and value parts are orthogonalised
apart (`split_qkv_rows`, `muon_batch.qkv_matrices`). `muon_ns_shapes` is what Newton-Schulz sees either way.

AdamW takes the rest: the embedding and the output head (their rows are per-token lookups, not a linear
map to orthogonalise), norms, and biases of any shape (a grouped `[E, out]` bias is E vectors).
Any other param of more than 2 dims is refused rather than silently given to AdamW.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, TypeVar

import torch

from moectl.core.config.schema import OptimizerConfig
from moectl.core.facts import GLU_ROWS_ATTR, QKV_ROWS_ATTR, GluRows, QkvRows
from trainer.distributed.ddp import DEFAULT_OPTIMIZER_TAG, is_expert_param
from trainer.optim.layerwise_layout import CostFn, plan_layerwise_buffer
from trainer.optim.muon import glu_split_shape, ns_cost, qkv_split_shapes

Rows = TypeVar("Rows", GluRows, QkvRows)

MUON_TAG = "muon"
ADAM_TAG = DEFAULT_OPTIMIZER_TAG
#: name prefixes of the embedding and the output head (Megatron-Core names, see trainer/model.py)
ADAM_MATRIX_PREFIXES = ("embedding.", "output_layer.")


def is_muon_param(name: str, param: torch.nn.Parameter) -> bool:
    """Whether Muon steps `param` (see the module docstring for the rule)."""
    leaf = name.rsplit(".", 1)[-1]
    if param.dim() < 2 or leaf.startswith("bias") or name.startswith(ADAM_MATRIX_PREFIXES):
        return False
    if param.dim() == 2:
        return True
    if param.dim() == 3 and (is_expert_param(param) or ".experts." in name):
        return True
    raise ValueError(
        f"{name}: a {param.dim()}-D param of shape {tuple(param.shape)} is neither a matrix nor a grouped "
        "[E, out, in] expert weight; Muon will not guess how to orthogonalise it, nor hand it to AdamW silently"
    )


def muon_tag(name: str, param: torch.nn.Parameter) -> str:
    """The `DistributedModel` optimizer tag of `param` in a Muon run: "muon" or "adam"."""
    return MUON_TAG if is_muon_param(name, param) else ADAM_TAG


def _marked(param: torch.nn.Parameter, attr: str, kind: type[Rows]) -> Optional[Rows]:
    """The row layout the model set on `param` as `attr` (a `kind`), None where it set none."""
    rows = getattr(param, attr, None)
    if rows is not None and not isinstance(rows, kind):
        raise TypeError(f"a param's {attr} must be a {kind.__name__}, got {rows!r}")
    return rows


def glu_rows(param: torch.nn.Parameter) -> Optional[GluRows]:
    """The gate/up row layout of a gated fc1 weight (set by the model), None for any other param."""
    return _marked(param, GLU_ROWS_ATTR, GluRows)


def split_glu_rows(param: torch.nn.Parameter, split_glu: bool) -> Optional[GluRows]:
    """The row layout Muon splits `param` by: its `glu_rows` with `optimizer.muon_split_glu`, else None."""
    return glu_rows(param) if split_glu else None


def qkv_rows(param: torch.nn.Parameter) -> Optional[QkvRows]:
    """The per-group query/key/value row layout of a fused QKV weight (set by the model), None for any other."""
    return _marked(param, QKV_ROWS_ATTR, QkvRows)


def split_qkv_rows(param: torch.nn.Parameter, split_qkv: bool) -> Optional[QkvRows]:
    """The row layout Muon splits `param` by: its `qkv_rows` with `optimizer.muon_split_qkv`, else None."""
    return qkv_rows(param) if split_qkv else None


def ns_shapes(shape: torch.Size, glu: Optional[GluRows], qkv: Optional[QkvRows]) -> list[torch.Size]:
    """What Newton-Schulz sees of a matrix of `shape` split by `glu` / `qkv` rows (None: not split): the shape
    itself, `[*lead, 2, F, in]` for gate and up halves, or the three stacked query, key and value parts."""
    if qkv is not None:
        return qkv_split_shapes(shape, qkv)
    return [shape if glu is None else glu_split_shape(shape)]


def muon_ns_shapes(param: torch.nn.Parameter, split_glu: bool, split_qkv: bool) -> list[torch.Size]:
    """The shapes Muon's Newton-Schulz sees for `param` (`ns_shapes` with the options' splits)."""
    return ns_shapes(param.shape, split_glu_rows(param, split_glu), split_qkv_rows(param, split_qkv))


def muon_cost(split_glu: bool = OptimizerConfig().muon_split_glu,
              split_qkv: bool = OptimizerConfig().muon_split_qkv) -> CostFn:
    """The layer-wise plan's cost of a param: `ns_cost` of what Muon orthogonalises (`muon_ns_shapes`)."""
    return lambda param: sum(ns_cost(s) for s in muon_ns_shapes(param, split_glu, split_qkv))


def muon_model_options(use_distributed_optimizer: bool, split_glu: bool = OptimizerConfig().muon_split_glu,
                       split_qkv: bool = OptimizerConfig().muon_split_qkv) -> dict[str, Any]:
    """`DistributedModel` keyword arguments of a Muon run: the tags, and the layer-wise layout for Muon.

    Sharded (distributed optimizer): Muon's buffers get `plan_layerwise_buffer` (whole matrices per
    shard), balanced by the cost of what Muon will orthogonalise (`split_glu`, `split_qkv`: the
    `optimizer.muon_split_*` options; the defaults are the config's). Plain DDP keeps the default layout:
    every rank steps every matrix.
    """
    planner = functools.partial(plan_layerwise_buffer, cost=muon_cost(split_glu, split_qkv))
    layouts = {MUON_TAG: planner} if use_distributed_optimizer else None
    return {"optimizer_tags": muon_tag, "layouts": layouts}
