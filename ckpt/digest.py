"""A shard file's recorded digest: from format 3 on, a sha256 tree over its header and its tensors.

Format 1 and 2 recorded the sha256 of the whole file, one sequential pass: on a rank writing 12.8 GB that
pass was the save's long pole (a core hashes 0.5-2 GB/s), and it came on top of a second pass hashing
each tensor for the manifest's tensor records. Format 3 records, for each file,

    sha256( sha256(header) || sha256(tensor 1) || ... || sha256(tensor n) )

over raw 32-byte digests: `header` is the file's first bytes up to its data section (the 8-byte length and
the JSON), the tensors in file order. safetensors' data section is indexed exactly (no holes, no overlap,
nothing after the last tensor: `ckpt.st_header` refuses anything else), so the header and the tensors
cover every byte of the file once, and the tree changes whenever any byte does. The tensor digests are
the manifest's tensor records (plain sha256 of each tensor's bytes, as in format 2): saving hashes every
byte once, on as many threads as there are tensors, and verifying hashes every byte once and names the
changed tensors from the same pass. The longest sequential hash is now the largest tensor, not the
largest file.

The manifest says which digest its files carry (`file_digest`, from format 3 on), so older checkpoints
keep verifying with the whole-file sha256 they recorded.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable

TREE = "sha256-tree"  # the manifest's `file_digest` from format 3 on
TREE_FROM_VERSION = 3


def tree_digest(header_sha256: str, tensor_sha256s: Iterable[str]) -> str:
    """The format 3 file digest from the header's sha256 and the tensors' sha256s, in file order (hex)."""
    h = hashlib.sha256(bytes.fromhex(header_sha256))
    for s in tensor_sha256s:
        h.update(bytes.fromhex(s))
    return h.hexdigest()


def uses_tree(manifest: dict[str, Any]) -> bool:
    """Whether the manifest's file records carry the tree digest (else the sha256 of the whole file)."""
    v = manifest.get("format_version", 1)
    return isinstance(v, int) and v >= TREE_FROM_VERSION
