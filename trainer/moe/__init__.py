"""Mixture-of-experts FFN: top-k router, token dispatch, and the grouped expert MLP (layouts x backends)."""

from trainer.moe.dispatch import DispatchPlan, LocalDispatcher
from trainer.moe.backends import get_backend
from trainer.moe.expert_math import ExpertSpec
from trainer.moe.experts import GroupedMLP
from trainer.moe.layer import MoELayer, MoEStats
from trainer.moe.router import RouterOutput, TopKRouter

__all__ = [
    "DispatchPlan",
    "ExpertSpec",
    "GroupedMLP",
    "LocalDispatcher",
    "MoELayer",
    "MoEStats",
    "RouterOutput",
    "TopKRouter",
    "get_backend",
]
