"""What tests that run `python -m moectl ...` as a child process share (import as `from cli_helpers import ...`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment for a moectl child: the repo importable, no terminal width or debug mode
    or thread count inherited from the test runner (nor the tests' own device switch, which moectl would warn
    about as a variable it does not read), then `extra`."""
    dropped = ("COLUMNS", "MOECTL_DEBUG", "OMP_NUM_THREADS", "MOECTL_TEST_TRAIN_DEVICE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def takes_no_file(folder: Path) -> bool:
    """Whether the OS refuses a new file in `folder` (/sys does, even to root: a test of an
    unwritable `--json` folder needs one)."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder)
    except OSError:
        return True
    os.close(fd)
    os.unlink(probe)
    return False
