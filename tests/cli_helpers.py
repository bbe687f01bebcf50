"""What tests that run `python -m moectl ...` as a child process share (import as `from cli_helpers import ...`)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment for a moectl child: the repo importable, no terminal width or debug mode
    or thread count inherited from the test runner, then `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "MOECTL_DEBUG", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env
