"""Option and argument definitions shared by several commands (one definition, one help text)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from moectl.cli.output import unwritable

ConfigArg = Annotated[Path, typer.Argument(help="YAML config file (e.g. configs/tiny.yaml).", show_default=False)]
OptionalConfigOpt = Annotated[
    Optional[Path], typer.Option("--config", "-c", help="YAML config file to use instead of the checkpoint's own.")
]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--set",
        "-s",
        help="Override one config key: --set section.key=value (value parsed as YAML; repeatable).",
        metavar="KEY=VALUE",
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout instead of a table.")]


def _json_path_usable(path: Optional[Path]) -> Optional[Path]:
    """Check a `--json PATH` before the command runs, and make its folder (the one place it is made; the
    commands only write the file): a run of minutes must not end in an error because the path is a folder, lies
    under a file, or is in a folder that takes no new file (read-only, /sys)."""
    if path is None:
        return None
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a folder; give a file path, e.g. {path / 'result.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((p for p in (path.parent, *path.parent.parents) if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a folder" if blocker is not None else e.strerror or str(e)
        raise typer.BadParameter(f"cannot make the folder {path.parent}: {why}; give another path") from None
    why = unwritable(path)
    if why is not None:
        raise typer.BadParameter(f"cannot write {path}: {why}; give a path in a writable folder")
    return path


JsonPathOpt = Annotated[
    Optional[Path],
    typer.Option("--json", help="Also write the results as JSON to this path.", callback=_json_path_usable),
]
WorldSizeOpt = Annotated[
    Optional[int],
    typer.Option("--world-size", "-w", min=1, help="Number of processes to check for (default: the smallest that fits)."),
]
NprocOpt = Annotated[
    int, typer.Option("--nproc-per-node", min=1, help="Processes (GPUs) on this machine; >1 launches through torchrun.")
]
# a str, not a Path: Path("") is ".", and an empty --run-dir (an unset variable) must reach rule MOE068
RunDirOpt = Annotated[Optional[str], typer.Option("--run-dir", help="Override run_dir from the config.")]


def examples(*lines: str) -> str:
    """An 'Examples' block for a command's help (Typer keeps the line breaks with \\b)."""
    body = "\n".join(f"  $ {line}" for line in lines)
    return f"\n\n\b\nExamples:\n{body}"
