"""The A/B environment switches of the trainer: `MOECTL_<NAME>=0` turns one fast path off for a comparison."""

from __future__ import annotations

import os


def switched_off(name: str) -> bool:
    """Whether the environment switch `name` is set to 0 (or false/off/no); unset means on."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "off", "no")
