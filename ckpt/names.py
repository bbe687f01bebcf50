"""Names on disk: step folders, shard files, the manifest and the `latest` pointer.

One place decides what a name means, so discovery, saving and verification can never disagree about
which folder is committed. Only a folder named exactly `step_<8 digits>` can be committed; anything with
a suffix (`.tmp-<nonce>` while a save is in flight, `.trash-<nonce>` while retention deletes it) is
ignored by discovery, whatever it contains.
"""

from __future__ import annotations

import re

MANIFEST = "manifest.json"
LATEST = "latest"

STEP_DIR_RE = re.compile(r"^step_(\d{8})$")
TMP_DIR_RE = re.compile(r"^step_(\d{8})\.tmp-([0-9a-f]+)$")
TRASH_DIR_RE = re.compile(r"^step_(\d{8})\.trash-([0-9a-f]+)$")
# The next `latest`, written beside it before a save's rename and moved over it after (ckpt/save.py `_commit`):
# left behind by a save killed between the two, it names the step that save committed (ckpt/discovery.py).
PENDING_LATEST_RE = re.compile(r"^latest\.tmp-([0-9a-f]+)$")
# The only data files a checkpoint may hold (docs/checkpoint.md): model weights and optimizer state.
SHARD_RE = re.compile(r"^(model|optim)-(\d{5})\.safetensors$")

MAX_STEP = 10**8 - 1


def step_dir_name(step: int) -> str:
    """`step_00000100` for step 100."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an int in [0, {MAX_STEP}], got {step!r}")
    return f"step_{step:08d}"


def tmp_dir_name(step: int, nonce: str) -> str:
    """The in-flight folder of a save: `step_00000100.tmp-<nonce>`."""
    return f"{step_dir_name(step)}.tmp-{nonce}"


def trash_dir_name(step: int, nonce: str) -> str:
    """Where retention moves a committed folder before deleting it."""
    return f"{step_dir_name(step)}.trash-{nonce}"


def shard_name(kind: str, index: int) -> str:
    """`model-00000.safetensors` / `optim-00003.safetensors`."""
    if kind not in ("model", "optim"):
        raise ValueError(f"shard kind must be 'model' or 'optim', got {kind!r}")
    if not 0 <= index <= 99999:
        raise ValueError(f"shard index must be in [0, 99999], got {index}")
    return f"{kind}-{index:05d}.safetensors"


def parse_step_dir(name: str) -> int | None:
    """The step of a committed-looking folder name, or None for any other name."""
    m = STEP_DIR_RE.match(name)
    return int(m.group(1)) if m else None
