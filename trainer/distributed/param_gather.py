"""Which storage each param gets under `mixed_precision.fp8_param_gather` / `fp4_param_gather`.

    fp8 tensorwise, delayed   PerTensorFP8Storage: FP8 bytes gathered, scales from a dp-wide amax
    fp8 blockwise             BlockwiseFP8Storage: FP8 bytes gathered, 128x128 block scales from a dp-wide
                              all-reduce of the block amaxes each shard touches (as Megatron and TE do)
    fp8 mxfp8                 StagedQuantizedStorage: bf16 staged (aliased on the grad buffer with
                              `reuse_grad_buf_for_mxfp8_param_ag`, else its own buffer), quantized locally
    fp4 nvfp4                 StagedQuantizedStorage, always aliased on the grad buffer
    fp8 rowwise               refused (rule MOE048): its columnwise copy is re-quantized along the other dim
                              from the high-precision weight, which no rank holds after a gather of bytes

Only weights the model runs through the recipe get quantized storage (`weight_sites.find_sites`); every
other param (embedding, head, norms, routers, biases) stays high precision in its own buffers.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

import torch

from moectl.core.config.schema import MixedPrecisionConfig
from moectl.core.errors import ConfigError
from trainer.distributed.ddp import StorageSpec
from trainer.distributed.blockwise_storage import BlockwiseFP8Storage
from trainer.distributed.param_storage import HighPrecisionStorage, ParamStorage
from trainer.distributed.quantized_storage import PerTensorFP8Storage, StagedQuantizedStorage
from trainer.distributed.weight_sites import find_sites
from trainer.precision import Recipe

PER_TENSOR = ("tensorwise", "delayed")
_BLOCK_LINEAR = re.compile(r"\.(?:linear_qkv|linear_proj|linear_fc1|linear_fc2)\.weight\d*$")


def is_block_linear(name: str) -> bool:
    """Whether a Megatron-style param name is a weight of a transformer-block linear (attention, dense or
    expert MLP), the params a model runs through the recipe."""
    return bool(_BLOCK_LINEAR.search(name))


def param_gather_enabled(mp: MixedPrecisionConfig) -> bool:
    return bool(mp.fp8_param_gather or mp.fp4_param_gather)


def make_storage(recipe: Recipe, sites: dict, mp: MixedPrecisionConfig) -> ParamStorage:
    """The quantized storage strategy for `recipe` (see the module docstring)."""
    if recipe.name in PER_TENSOR:
        return PerTensorFP8Storage(recipe, sites)
    if recipe.name == "blockwise":
        return BlockwiseFP8Storage(recipe, sites)
    if recipe.name == "mxfp8":
        return StagedQuantizedStorage(recipe, sites, aliased=mp.reuse_grad_buf_for_mxfp8_param_ag)
    if recipe.name == "nvfp4":
        return StagedQuantizedStorage(recipe, sites, aliased=True)
    raise ConfigError(
        "mixed_precision.fp8_recipe", recipe.name,
        "low-precision param gather supports tensorwise, delayed, blockwise, mxfp8 and nvfp4 (rule MOE048)",
        fix="set mixed_precision.fp8_param_gather=false, or fp8_recipe to tensorwise, delayed, blockwise or mxfp8",
    )  # fmt: skip


def param_gather_storage(model: torch.nn.Module, mp: MixedPrecisionConfig,
                         recipe: Optional[Recipe]) -> StorageSpec:  # fmt: skip
    """The `StorageSpec` for `DistributedModel`: quantized storage for the recipe's weights.

    With a recipe but param gather off, the recipe's weights stay high precision yet get a buffer key of
    their own, so the buffer layout (and with it the bucket split of the global grad norm, hence the clip
    factor's last bits) is the same with gather on and off: the two runs then differ only by the gather,
    and are bitwise equal for mxfp8/nvfp4 (seed 001's ON-vs-OFF test) instead of drifting by an ulp.
    """
    if not param_gather_enabled(mp):
        if recipe is None:
            return None
        sites = find_sites(model)
        if not sites:
            return None
        mirror, high = RecipeSiteStorage(), HighPrecisionStorage()
        return lambda name, p: mirror if p in sites else high
    which = "fp8_param_gather" if mp.fp8_param_gather else "fp4_param_gather"
    if recipe is None:
        raise ConfigError(f"mixed_precision.{which}", True, "low-precision param gather needs an fp8/fp4 recipe",
                          fix="set mixed_precision.fp8 (or fp4), or turn param gather off")  # fmt: skip
    sites = find_sites(model)
    if not sites:
        raise ConfigError(f"mixed_precision.{which}", True,
                          "the model runs no layer through the recipe, so no weight can be stored quantized",
                          fix="build the model with recipe=get_recipe(cfg.mixed_precision)")  # fmt: skip
    quantized = make_storage(recipe, sites, mp)
    high = HighPrecisionStorage()
    return lambda name, p: quantized if p in sites else high


class RecipeSiteStorage(HighPrecisionStorage):
    """High-precision storage of a recipe's weights under their own buffer key (see `param_gather_storage`)."""

    @property
    def key(self) -> str:
        return "high_precision:recipe_site"


def storage_by_name(recipe: Recipe, mp: MixedPrecisionConfig,
                    quantized: Callable[[str], bool] = is_block_linear) -> StorageSpec:  # fmt: skip
    """A `StorageSpec` for bare parameters without their layers (benchmarks): quantized storage for the
    names `quantized` picks, whose values the storage itself holds (no module reads them)."""
    storage = make_storage(recipe, {}, mp)
    high = HighPrecisionStorage()
    return lambda name, p: storage if quantized(name) else high
