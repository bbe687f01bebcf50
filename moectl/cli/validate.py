"""`moectl validate-config`: every rule over the resolved config, all violations at once, no GPU touched.

Exit codes: 0 valid (warnings allowed), 1 violations, 2 unreadable input (missing file, bad YAML,
unknown key, type error: the loader raises those as exit-code-2 errors). Nothing here imports torch;
the hardware rule does so lazily, and only when a GPU looks present (see `moectl.core.rules`).
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Optional, Sequence

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moectl.cli.base import app, command
from moectl.cli.console import make_console
from moectl.cli.options import JsonFlag, SetOpt, WorldSizeOpt, examples
from moectl.core.config import Config
from moectl.core.config.load import load_config
from moectl.core.errors import MoectlError, UsageError
from moectl.core.gpu_memory import parse_gpu_memory
from moectl.core.rules import RETIRED, RULES, Context, Device, Environment, Violation, check, default_world_size, fmt, has_errors
from moectl.core.summary import summarize, summary_lines

ConfigOptArg = Annotated[
    Optional[Path],
    typer.Argument(help="YAML config file (e.g. configs/tiny.yaml); optional with --explain.", show_default=False),
]
DeviceCapabilityOpt = Annotated[
    Optional[str],
    typer.Option(
        "--device-capability",
        metavar="MAJOR.MINOR|cpu",
        help="Check recipes against this device (9.0 = Hopper, 10.0 = Blackwell, cpu) instead of the visible GPU.",
    ),
]
GpuMemoryOpt = Annotated[
    Optional[str],
    typer.Option(
        "--gpu-memory",
        metavar="GIB|GPU",
        help="Warn (rule MOE056) when the per-rank memory estimate does not fit one GPU of this many GiB, or of "
        "this kind (H100, H200, A100, A100-40GB, B200, ...).",
    ),
]
ExplainOpt = Annotated[
    Optional[str],
    typer.Option(
        "--explain", metavar="RULE", help="Print why rule RULE exists (e.g. MOE012; 'all' lists every rule) and exit."
    ),
]


def parse_device_capability(text: str) -> tuple[int, int] | str:
    """'9.0' / '90' / 'sm90' / 'sm_100' -> (major, minor); 'cpu' -> 'cpu'. UsageError otherwise."""
    t = text.strip().lower()
    if t == "cpu":
        return "cpu"
    m = re.fullmatch(r"(\d+)\.(\d)", t) or re.fullmatch(r"(?:sm_?)?(\d+)(\d)", t)
    if not m:
        raise UsageError(
            f"--device-capability {text!r}: expected MAJOR.MINOR (e.g. 9.0), smXY (e.g. sm90) or cpu",
            "pass e.g. --device-capability 9.0 for H100/H200 or 10.0 for B200",
        )
    return int(m.group(1)), int(m.group(2))


def _keys_text(keys: dict[str, Any]) -> str:
    return "\n".join(f"{k}={fmt(v)}" for k, v in keys.items())


#: the narrowest console that gets the violations as a table; a narrower one gets a line each
NARROW_TABLE = 80


def print_violations(violations: Sequence[Violation], console: Console, lines: bool = False) -> None:
    """The violations as a Rich table: rule, severity, keys=values, reason, fix (also used by `train`). `lines`:
    one plain line each instead (`severity: RULE keys=values: reason. fix: ...`), what a log file reads best."""
    # Five columns in a narrow terminal fold every cell to a few letters (COLUMNS=40 split MOE018 into "MOE01"
    # over "8", and keys, reason and fix into 5-letter strips): the plain lines wrap as prose instead.
    if lines or console.width < NARROW_TABLE:
        for v in violations:
            keys = ", ".join(f"{k}={fmt(x)}" for k, x in v.keys.items())
            console.print(f"{v.severity}: {v.rule} {keys}: {v.message}. fix: {v.fix}", markup=False,
                          highlight=False, soft_wrap=True)  # fmt: skip
        return
    table = Table(show_lines=True, expand=False)
    for name, style in (("rule", "bold"), ("severity", ""), ("keys", "cyan"), ("reason", ""), ("fix", "green")):
        table.add_column(name, style=style, overflow="fold")
    for v in violations:
        sev = f"[red]{v.severity}[/]" if v.severity == "error" else f"[yellow]{v.severity}[/]"
        # escaped: messages hold shapes (`[vocab_size, hidden_size]`) and values that Rich would read as markup
        table.add_row(v.rule, sev, escape(_keys_text(v.keys)), escape(v.message), escape(v.fix))
    console.print(table)


def _explain(rule_id: str, as_json: bool, console: Console) -> None:
    if rule_id.strip().lower() == "all":
        if as_json:
            typer.echo(json.dumps([_rule_json(r.id) for r in RULES.values()], indent=2))
            return
        table = Table(show_lines=False)
        for name in ("rule", "family", "severity", "summary"):
            table.add_column(name, overflow="fold", no_wrap=name == "rule", min_width=6 if name == "rule" else None)
        for r in RULES.values():
            table.add_row(r.id, r.family, r.severity, escape(r.summary))
        console.print(table)
        return
    rid = rule_id.strip().upper()
    if rid in RETIRED:
        raise UsageError(f"--explain {rid}: retired rule: {RETIRED[rid]}", "--explain all lists the rules in use")
    if rid not in RULES:
        raise UsageError(f"--explain {rule_id!r}: no such rule", _explain_hint(rid))
    if as_json:
        typer.echo(json.dumps(_rule_json(rid), indent=2))
        return
    r = RULES[rid]
    console.print(f"[bold]{r.id}[/] ({r.family}, {r.severity}): {r.summary}")
    console.print(f"reads: {', '.join(r.keys)}")
    console.print()
    console.print(r.rationale, markup=False)


def _rule_json(rid: str) -> dict[str, Any]:
    r = RULES[rid]
    return {
        "rule": r.id,
        "family": r.family,
        "severity": r.severity,
        "keys": list(r.keys),
        "summary": r.summary,
        "rationale": r.rationale,
    }


@command(
    app,
    name="validate-config",
    help="Check a config against every rule and print all violations (no GPU touched, no model built)."
    " Exit code 0: valid (warnings allowed), 1: violations, 2: unreadable config."
    + examples(
        "moectl validate-config configs/tiny.yaml",
        "moectl validate-config configs/mxfp8_param_gather.yaml --world-size 8 --device-capability 9.0",
        "moectl validate-config configs/mixtral_8x7b_like.yaml --world-size 8 --gpu-memory H100",
        "moectl validate-config configs/tiny.yaml --set mixed_precision.fp8=e4m3 --set optimizer.lr=3e-4 --json",
        "moectl validate-config --explain MOE010",
        "moectl validate-config --explain all",
    ),
)
def validate_config(
    config: ConfigOptArg = None,
    set_: SetOpt = None,
    json_: JsonFlag = False,
    world_size: WorldSizeOpt = None,
    device_capability: DeviceCapabilityOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    explain: ExplainOpt = None,
) -> None:
    """Validate CONFIG (after --set overrides) for --world-size ranks."""
    console = make_console()
    if explain is not None:
        _explain(explain, json_, console)
        return
    if config is None:
        raise UsageError("missing CONFIG", "pass a YAML config, e.g. moectl validate-config configs/tiny.yaml")
    cap = parse_device_capability(device_capability) if device_capability is not None else None
    try:
        gpu = parse_gpu_memory(gpu_memory) if gpu_memory is not None else None
    except ValueError as e:
        raise UsageError(str(e), "pass e.g. --gpu-memory 80 or --gpu-memory H100") from None
    try:
        cfg = load_config(config, list(set_ or []))
    except MoectlError as e:
        if json_:  # a config that cannot be loaded still gives a script one JSON object (the lines go to stderr)
            typer.echo(json.dumps({"valid": False, "load_errors": e.lines(), "violations": [], "summary": None},
                                  indent=2))  # fmt: skip
        raise
    world = world_size if world_size is not None else default_world_size(cfg)
    # One Environment for the rules and the summary line, so the machine is probed at most once.
    env = Environment(device=Device("cpu", None, "--device-capability cpu")) if cap == "cpu" else Environment()
    capability = cap if isinstance(cap, tuple) else None
    violations = check(cfg, world, capability, env, gpu)
    device = Context(cfg, world, capability, env).device
    try:
        # sizes past torch's (MOE075) give counts and memory of 10^14 TiB: no meaningful summary either
        summary = None if any(v.rule == "MOE075" for v in violations) else summarize(cfg, world)
    except (ValueError, ZeroDivisionError):  # sizes the rules already reject; no meaningful summary
        summary = None

    valid = not has_errors(violations)
    if json_:
        out = {
            "valid": valid,
            "load_errors": [],
            "violations": [v.to_json() for v in violations],
            "summary": {**summary.to_json(), "device": device.describe() if device else None} if summary else None,
        }
        typer.echo(json.dumps(out, indent=2))
    else:
        _print_human(config, violations, summary, cfg, device, console)
    if not valid:
        raise typer.Exit(1)


def _print_human(
    config: Path, violations: Sequence[Violation], summary: Any, cfg: Config, device: Optional[Device], console: Console
) -> None:
    if violations:
        print_violations(violations, console)
    rows = (
        summary_lines(summary, cfg)
        if summary is not None
        else [("summary", "skipped: fix the size errors above first")]
    )
    where = device.describe() if device else "unknown: no GPU visible (pass --device-capability 9.0 to check recipes)"
    for label, text in [*rows, ("device", where)]:
        console.print(f"[bold]{label:7}[/] {text}", highlight=False)
    errors = sum(v.severity == "error" for v in violations)
    warnings = len(violations) - errors
    if errors:
        console.print(f"[red]{config}: invalid[/] ({errors} error(s), {warnings} warning(s))", highlight=False)
    else:
        console.print(f"[green]{config}: valid[/] ({warnings} warning(s))", highlight=False)


def _explain_hint(rid: str) -> str:
    """The fix for an unknown `--explain` id. Ids differ only in their number, so spelling similarity means
    nothing between two well-formed ids (MOE999 is not "close to" MOE069): a well-formed one gets the range. A
    mistyped prefix or padding (`MEO042`, `MOE42`, `42`) is read by its number; else the closest spelling
    (`MOE0100`: MOE010)."""
    if re.fullmatch(r"MOE\d{3}", rid) is None:
        digits = re.fullmatch(r"[A-Z]*0*(\d{1,3})", rid)
        guess = f"MOE{int(digits[1]):03d}" if digits else None
        if guess in RETIRED:
            return f"{guess} is retired ({RETIRED[guess]}); --explain all lists the rules in use"
        # spelling helps only with a digit too many (MOE0100); without digits, or past the range, nothing
        many = len(re.sub(r"\D", "", rid)) > 3
        close = [guess] if guess in RULES else difflib.get_close_matches(rid, list(RULES), n=1, cutoff=0.85) if many else []
        if close:
            return f"did you mean {close[0]}?"
    return f"rules are {min(RULES)}..{max(RULES)}; --explain all lists them"
