"""The errors a user sees.

Every failure that is the user's to fix (a config, a flag, a data file, a checkpoint) is a `MoectlError`.
The CLI prints it as one line, `error: <what>. fix: <how>`, and exits with the error's `exit_code`;
`MOECTL_DEBUG=1` prints the traceback above that line. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from typing import Any


class MoectlError(Exception):
    """A user-facing error: what went wrong, and how to fix it."""

    exit_code: int = 1

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def lines(self) -> list[str]:
        """The lines the CLI prints, one per culprit (`one_line`, but several for `ConfigErrors`)."""
        return [self.one_line()]

    def one_line(self) -> str:
        """The error as the single line the CLI prints."""
        line = _unstop(self.message)
        if self.fix:
            line += f"{' ' if line.endswith(('?', '!', '...')) else '. '}fix: {_unstop(self.fix)}"
        return line


def _unstop(text: str) -> str:
    """`text` without its closing full stop (the line adds its own); an ellipsis or other text stays whole."""
    text = text.rstrip()
    return text[:-1].rstrip() if text.endswith(".") and not text.endswith("...") else text


class ConfigError(MoectlError):
    """A bad key or value in a config file or a `--set` override (exit code 2: bad usage)."""

    exit_code = 2

    def __init__(self, key: str, value: Any, message: str, fix: str | None = None, *, section: bool = False) -> None:
        """`section`: `key` names a whole section (a mistyped one): its name says it, its contents do not."""
        if not key:
            text = message
        elif section:
            text = f"{key} (a section): {message}"
        else:
            text = f"{key}={_short(value)}: {message}"
        super().__init__(text, fix)
        self.key = key
        self.value = value


class ConfigErrors(ConfigError):
    """Several bad keys or values of one config, each its own `ConfigError` (printed one line each)."""

    def __init__(self, errors: list[ConfigError]) -> None:
        # the whole text as the exception's own (tracebacks, `str(e)`); key and value are the first error's
        MoectlError.__init__(self, f"{len(errors)} config errors: " + "; ".join(e.one_line() for e in errors))
        self.key, self.value = errors[0].key, errors[0].value
        self.errors = errors

    def lines(self) -> list[str]:
        """One line per bad key or value, each with its own fix."""
        return [e.one_line() for e in self.errors]


def _short(value: Any, limit: int = 80) -> str:
    """`value` as YAML spells its scalars (null, true; strings quoted), cut to `limit` characters: a mistyped
    section name must not print the whole section."""
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class UsageError(MoectlError):
    """A bad command-line flag or an unreadable input file (exit code 2)."""

    exit_code = 2


class DataError(MoectlError):
    """A data source that cannot be read as configured."""


class CheckpointError(MoectlError):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit the model."""


class CheckpointArgumentError(CheckpointError):
    """A checkpoint argument that names nothing usable: a path that does not exist, is a file, a run folder or any
    other folder that is no checkpoints folder (a Hugging Face model folder, an empty one), a destination that
    already does, an option value no checkpoint can take, an import's --set that contradicts the model. The
    command's fault, not a checkpoint's (exit 2: to a script, exit 1 of `ckpt validate` means a bad checkpoint,
    a checkpoints folder with no step committed yet included)."""

    exit_code = 2
