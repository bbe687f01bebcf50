"""The manifest's own digest: every field of manifest.json under one sha256, so no edit goes unnoticed.

The files and tensors were hashed, but the run state beside them was not: editing
`train_state.optimizer_step`, `consumed_samples`, `sampler.seed`, `rng` or the stored config passed
`ckpt validate` and resumed, silently changing training (issue 18). Since format version 2 the manifest
carries `manifest_sha256`, the sha256 of every other field in a canonical JSON form (keys sorted, no
spaces, ASCII): any edit of any field, even one that re-indents nothing, changes it; re-indenting alone
does not. It is checked wherever the format verifies (`verify_checkpoint`, and `open_checkpoint` even
without full verification) and reported by `ckpt validate`.

What it is not: a signature. Anyone who can write the folder can recompute it; it catches edits, tools
and bit rot, not an adversary (docs/checkpoint.md).

Format 1 manifests (written before the digest existed) still load, with a warning that their run state is
unchecked: refusing them would strand every earlier checkpoint, and the per-file and per-tensor hashes
still protect their tensors. A format 2 manifest without its digest is refused (it was removed), so the
only way around the check is to rewrite the manifest as format 1 on purpose.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

DIGEST_KEY = "manifest_sha256"
SEALED_FROM_VERSION = 2


def digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's fields other than the digest, in canonical JSON."""
    body = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with its digest as the last field."""
    body = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    return {**body, DIGEST_KEY: digest(body)}


def seal_problem(manifest: dict[str, Any]) -> str | None:
    """Why the manifest's digest does not hold (None when it holds, or for a format 1 manifest)."""
    if manifest.get("format_version", 1) < SEALED_FROM_VERSION:
        return None
    recorded = manifest.get(DIGEST_KEY)
    if recorded is None:
        return f"{DIGEST_KEY} is missing: a format {manifest.get('format_version')} manifest always has one"
    actual = digest(manifest)
    if recorded != actual:
        return (f"was edited after the save: {DIGEST_KEY} records {str(recorded)[:12]}..., its fields hash to "
                f"{actual[:12]}...; its run state (step, optimizer step, samples, sampler, RNG, config) cannot be "
                "trusted")  # fmt: skip
    return None


def unsealed_note(manifest: dict[str, Any]) -> str | None:
    """The warning for a format 1 manifest, which has no digest (None for a sealed one)."""
    if manifest.get("format_version", 1) >= SEALED_FROM_VERSION:
        return None
    return (f"manifest format {manifest.get('format_version')} has no {DIGEST_KEY} (written before moectl sealed "
            "manifests): its run state (step, optimizer step, samples, sampler, RNG, config) is not integrity-checked; "
            "its tensors are")  # fmt: skip
