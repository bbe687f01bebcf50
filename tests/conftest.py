"""Shared test settings: GPU tests are skipped cleanly where CUDA is absent (they run on the device tool)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
