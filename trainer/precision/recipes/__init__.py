"""The low-precision recipes, one file each; `get_recipe(cfg)` picks one from the config."""

from __future__ import annotations

from .base import Recipe
from .blockwise import BlockwiseRecipe
from .delayed import AmaxHistory, DelayedRecipe, DelayedState
from .mxfp8 import MXFP8Recipe
from .nvfp4 import NVFP4Recipe
from .registry import FP4_RECIPES, FP8_RECIPES, get_recipe
from .rowwise import RowwiseRecipe
from .tensorwise import TensorwiseRecipe

__all__ = [
    "AmaxHistory",
    "BlockwiseRecipe",
    "DelayedRecipe",
    "DelayedState",
    "FP4_RECIPES",
    "FP8_RECIPES",
    "MXFP8Recipe",
    "NVFP4Recipe",
    "Recipe",
    "RowwiseRecipe",
    "TensorwiseRecipe",
    "get_recipe",
]
