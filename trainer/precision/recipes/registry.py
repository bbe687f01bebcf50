"""`get_recipe`: the recipe a `MixedPrecisionConfig` asks for (None when neither fp8 nor fp4 is on)."""

from __future__ import annotations

from typing import Optional

from moectl.core.config.schema import MixedPrecisionConfig
from moectl.core.errors import ConfigError

from .base import Recipe
from .blockwise import BlockwiseRecipe
from .delayed import DelayedRecipe
from .mxfp8 import MXFP8Recipe
from .nvfp4 import NVFP4Recipe
from .rowwise import RowwiseRecipe
from .tensorwise import TensorwiseRecipe

FP8_RECIPES: dict[str, type[Recipe]] = {
    "tensorwise": TensorwiseRecipe,
    "delayed": DelayedRecipe,
    "rowwise": RowwiseRecipe,
    "blockwise": BlockwiseRecipe,
    "mxfp8": MXFP8Recipe,
}
FP4_RECIPES: dict[str, type[Recipe]] = {"nvfp4": NVFP4Recipe}


def get_recipe(cfg: MixedPrecisionConfig) -> Optional[Recipe]:
    """The low-precision recipe for the linear layers, or None (bf16/fp32 compute) when fp8 and fp4 are off.

    Raises ConfigError when both are on (they are exclusive, as in Megatron) or a name is unknown.
    """
    if cfg.fp8 and cfg.fp4:
        raise ConfigError("mixed_precision.fp4", cfg.fp4, "fp8 and fp4 are exclusive", "turn one of them off")
    if cfg.fp8:
        cls = FP8_RECIPES.get(cfg.fp8_recipe)
        if cls is None:
            raise ConfigError("mixed_precision.fp8_recipe", cfg.fp8_recipe, "unknown fp8 recipe", f"use one of {', '.join(FP8_RECIPES)}")
        return cls(fp8_format=cfg.fp8, emulate=cfg.emulate, fast_accum_backward=cfg.fp8_fast_accum_backward)
    if cfg.fp4:
        cls = FP4_RECIPES.get(cfg.fp4_recipe)
        if cls is None:
            raise ConfigError("mixed_precision.fp4_recipe", cfg.fp4_recipe, "unknown fp4 recipe", f"use one of {', '.join(FP4_RECIPES)}")
        return cls(fp8_format=None, emulate=cfg.emulate)
    return None
