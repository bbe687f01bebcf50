"""A `Problem`: one thing wrong with a checkpoint, naming the file and (where it applies) the tensor."""

from __future__ import annotations

import errno
from dataclasses import dataclass

# Kinds, so tools can group and tests can assert without matching prose.
INCOMPLETE = "incomplete"  # no commit marker: the save never finished
MANIFEST = "manifest"  # manifest.json unreadable, wrong version or schema
MISSING_FILE = "missing-file"  # a file the manifest lists is absent
UNEXPECTED_FILE = "unexpected-file"  # a file the manifest does not list (e.g. a pickle)
SIZE = "size"  # file size differs from the manifest
SHA256 = "sha256"  # file or tensor bytes differ from the manifest
HEADER = "header"  # the safetensors header is malformed or inconsistent
TENSOR_SET = "tensor-set"  # tensors missing, unexpected, or with another dtype/shape than recorded
UNREADABLE = "unreadable"  # the operating system refused to read a file (permissions, I/O error)


@dataclass(frozen=True)
class Problem:
    """One problem found in a checkpoint folder.

    `file` is a name inside the step folder (None only when the folder itself is the problem), `tensor`
    the tensor concerned where one is, `kind` one of the constants above. `denied`: an UNREADABLE problem
    that is the OS refusing this user (permissions), not the checkpoint's bytes: the checkpoint may be fine.
    """

    kind: str
    file: str | None
    tensor: str | None
    message: str
    denied: bool = False

    def __str__(self) -> str:
        where = self.file or "<folder>"
        if self.tensor is not None:
            where += f" tensor {self.tensor!r}"
        return f"{where}: {self.message}"


def unreadable(file: str | None, e: OSError, what: str = "cannot be read") -> Problem:
    """The UNREADABLE problem for the OS's refusal `e` to read `file` (None: the step folder itself), `what`
    saying what could not be done; `denied` when it is a permission (EACCES, EPERM), not an I/O error."""
    return Problem(UNREADABLE, file, None, f"{what}: {e.strerror or e}", denied=e.errno in (errno.EACCES, errno.EPERM))
