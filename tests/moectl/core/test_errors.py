"""The one line an error prints (moectl/core/errors.py): message and fix joined once, nothing cut."""

from __future__ import annotations

import pytest

from moectl.core.errors import MoectlError


@pytest.mark.parametrize(
    ("message", "fix", "line"),
    [
        ("a is bad.", "set b.", "a is bad. fix: set b"),
        ("a is bad", None, "a is bad"),
        # an ellipsis is text, not a full stop: it was cut to "..., " before
        ("a list", "start with 'model:', 'moe:', ...", "a list. fix: start with 'model:', 'moe:', ..."),
        ("no such step; did you mean step_10?", "pass that", "no such step; did you mean step_10? fix: pass that"),
        ("entries: momentum_buffer .", "load them", "entries: momentum_buffer. fix: load them"),
    ],
)
def test_one_line_joins_message_and_fix_without_cutting_them(message: str, fix: str | None, line: str) -> None:
    assert MoectlError(message, fix).one_line() == line
