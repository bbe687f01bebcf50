"""The `moectl` command: imports every command module (each registers itself on `app`)."""

from __future__ import annotations

from moectl.cli.base import app
from moectl.cli import validate  # noqa: F401
from moectl.cli import bench  # noqa: F401
from moectl.cli import bench_train  # noqa: F401
from moectl.cli import bench_ckpt  # noqa: F401
from moectl.cli import train  # noqa: F401
from moectl.cli import ckpt  # noqa: F401
from moectl.cli import parity  # noqa: F401
from moectl.cli import config_cmd  # noqa: F401

__all__ = ["app", "main"]


def main() -> None:
    """Console entry point."""
    app()
