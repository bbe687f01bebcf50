"""Which params Muon steps and which AdamW steps in a Muon run (the optimizer tags of `DistributedModel`).

Muon takes the hidden matrices, as in Megatron (`megatron/core/optimizer`, `use_muon` and `dim() == 2`,
not the embedding or the output head), Keller Jordan's post and Moonlight:

- every 2-D weight: attention QKV (orthogonalised as one matrix: moectl does not split Q, K and V),
  attention output, dense MLP, the experts' per-expert `weight{e}` (fc1's gate and up rows jointly), and
  the router `[E, hidden]` (a 2-D matrix like any other, as Megatron routes it);
- a grouped `[E, out, in]` expert weight: each expert slice orthogonalised alone by one batched
  Newton-Schulz. Megatron silently hands this 3-D param to Adam; here it takes the same math as the
  per-expert layout, so the two layouts train alike.

AdamW takes the rest: the embedding and the output head (their rows are per-token lookups, not a linear
map to orthogonalise), norms, and biases of any shape (a grouped `[E, out]` bias is E vectors).
Any other param of more than 2 dims is refused rather than silently given to AdamW.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.distributed.ddp import DEFAULT_OPTIMIZER_TAG, is_expert_param
from trainer.optim.layerwise_layout import plan_layerwise_buffer

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


def muon_model_options(use_distributed_optimizer: bool) -> dict[str, Any]:
    """`DistributedModel` keyword arguments of a Muon run: the tags, and the layer-wise layout for Muon.

    Sharded (distributed optimizer): Muon's buffers get `plan_layerwise_buffer` (whole matrices per
    shard). Plain DDP keeps the default layout: every rank steps every matrix.
    """
    layouts = {MUON_TAG: plan_layerwise_buffer} if use_distributed_optimizer else None
    return {"optimizer_tags": muon_tag, "layouts": layouts}
