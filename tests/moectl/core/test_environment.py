"""The table of moectl's environment variables (moectl/core/environment.py) and the warning about unknown ones.

The table and the code agree both ways: every `MOECTL_*` name the packages spell is in it, and every entry is
read somewhere (a removed switch must leave the table too). An unknown name is one warning line with the close
known name; known names and other variables say nothing; the CLI prints it once, before the command runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moectl.cli.app import app
from moectl.core.environment import ENV, unknown_variables

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("moectl", "trainer", "ckpt")


def _names_in_code() -> set[str]:
    names: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            if path.name == "environment.py":  # the table itself does not count as reading a name
                text = re.sub(r"\nENV: dict\[str, str\] = \{.*?\n\}\n", "\n", text, flags=re.S)
            # a name spelled whole (an f-string's `MOECTL_NS_{name}` stem ends in `_` and is not one)
            names |= {n for n in re.findall(r"MOECTL_[A-Z0-9_]+", text) if not n.endswith("_")}
    return names


def test_every_name_in_the_code_is_in_the_table() -> None:
    missing = _names_in_code() - set(ENV)
    assert not missing, f"add these to moectl/core/environment.py: {sorted(missing)}"


def test_every_entry_of_the_table_is_read_somewhere() -> None:
    code = "\n".join((ROOT / p / "kernels" / "ns_gemm_triton.py").read_text() for p in ("trainer",))
    tile_overrides = {f"MOECTL_NS_{n}" for n in re.findall(r'_config\("([A-Z0-9_]+)"', code)}
    tile_overrides |= {f"MOECTL_NS_{n}" for n in re.findall(r'\("([A-Z0-9_]+)", [A-Z0-9_]+_CONFIG\)', code)}
    stale = set(ENV) - _names_in_code() - tile_overrides
    assert not stale, f"no code reads these: {sorted(stale)}"


def test_an_unknown_name_gets_one_line_with_the_close_one() -> None:
    lines = unknown_variables({"MOECTL_TRITON_ROPEE": "0", "MOECTL_DEBUG": "1", "PATH": "/bin", "MOECTL_XYZ": "1"})
    assert len(lines) == 2
    assert "MOECTL_TRITON_ROPEE" in lines[0] and "did you mean MOECTL_TRITON_ROPE?" in lines[0]
    assert "MOECTL_XYZ" in lines[1] and "no such variable" in lines[1]
    assert unknown_variables({"MOECTL_TRITON_ROPE": "0", "HOME": "/root"}) == []


@pytest.mark.parametrize(("rank", "warned"), [(None, True), ("0", True), ("1", False)])
def test_the_cli_warns_once_before_the_command(rank: str | None, warned: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOECTL_TRITON_TOPKK", "0")
    monkeypatch.delenv("MOECTL_OUTCOME_DIR", raising=False)
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    result = CliRunner().invoke(app, ["validate-config", str(ROOT / "configs" / "tiny.yaml")])
    assert result.exit_code == 0, result.output
    assert ("MOECTL_TRITON_TOPKK" in result.output) == warned
    if warned:
        assert "did you mean MOECTL_TRITON_TOPK?" in result.output
