"""The README's two commands stay true: the test command is what CI runs, and the main job's config exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    return re.findall(r"```bash\n(pip install[^\n]*)\n```", (ROOT / "README.md").read_text())


def test_readme_test_command_is_what_ci_runs():
    install_main, install_test = _commands()
    ci = (ROOT / ".ci" / "run").read_text()
    for part in install_test.split(" && "):
        cmd = part.replace("pip install", "python3 -m pip install --quiet")
        assert cmd in ci, f"{part!r} (README) is not in .ci/run"


def test_readme_main_job_uses_a_shipped_config():
    install_main, _ = _commands()
    config = install_main.split("moectl train ")[1].split()[0]
    assert (ROOT / config).is_file()
