"""`moectl ckpt ...`: inspect, convert, export-hf and import-hf (validate joins them here).

One function per command, each a thin shell over `ckpt.*` (which holds the logic and is tested without
the CLI). Errors are `MoectlError`s, printed by `command` as one line and ending the command with the error's
own exit code: 1 for a `CheckpointError` (a bad checkpoint, or a checkpoints folder with no step committed yet:
exit 1 of `ckpt validate` means that to a script), 2 for the command's own fault, a `CheckpointArgumentError`
(a path that does not exist or is no checkpoint, a destination that exists, an option value no checkpoint
can take) or a `UsageError`/`ConfigError` (a bad flag, --config or --set). Heavy imports (torch, the
checkpoint modules) happen inside the commands so `moectl --help` stays fast.
"""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from moectl.cli.base import app, command, new_app
from moectl.cli.console import make_console
from moectl.cli.options import JsonFlag, SetOpt, examples
from moectl.core.errors import MoectlError, UsageError

ckpt_app = new_app("ckpt", "Inspect, convert, validate and export moectl checkpoints.")
app.add_typer(ckpt_app, name="ckpt")

CkptArg = Annotated[
    Path, typer.Argument(help="A checkpoint step folder, or a checkpoints folder (then the step its `latest` names).",
                         show_default=False),
]  # fmt: skip
NewDirArg = Annotated[Path, typer.Argument(help="New output folder (must not exist).", show_default=False)]


class LayoutChoice(str, Enum):
    single_grouped = "single-grouped"
    per_expert = "per-expert"


class HFFormat(str, Enum):
    mixtral = "mixtral"
    qwen3_moe = "qwen3-moe"


def _interleave(text: Optional[str]) -> Any:
    """--glu-interleave-size: absent = keep, 'none' = contiguous [gate; up], N = blocks of N rows."""
    from ckpt.convert import KEEP

    if text is None:
        return KEEP
    if text.strip().lower() in ("none", "null"):
        return None
    if text.strip().isdigit() and int(text) > 0:
        return int(text)
    raise UsageError(f"--glu-interleave-size {text!r}: expected a positive int or none",
                     "e.g. --glu-interleave-size 32")  # fmt: skip


@command(
    ckpt_app,
    name="convert",
    stoppable=True,
    help="Rewrite a checkpoint's expert weights, fp32 masters and optimizer moments in the other layout "
    "(bit-exact both ways). DST is a new checkpoints folder; the step keeps its number."
    + examples(
        "moectl ckpt convert runs/tiny/checkpoints runs/tiny/per_expert --layout per-expert",
        "moectl ckpt convert runs/tiny/checkpoints/step_00000100 /tmp/grouped --layout single-grouped",
        "moectl ckpt convert runs/tiny/checkpoints /tmp/plain --layout single-grouped --glu-interleave-size none",
    ),
)
def convert_command(
    src: CkptArg,
    dst: NewDirArg,
    layout: Annotated[LayoutChoice, typer.Option("--layout", help="Target expert layout.", show_default=False)],
    glu_interleave_size: Annotated[
        Optional[str],
        typer.Option("--glu-interleave-size", metavar="N|none",
                     help="Also reorder fc1 rows to this interleave (default: keep)."),  # fmt: skip
    ] = None,
) -> None:
    from ckpt.convert import convert_checkpoint

    out = convert_checkpoint(src, dst, layout.value, glu_interleave_size=_interleave(glu_interleave_size))
    make_console().print(f"[green]converted[/] {src} -> {out} ({layout.value})", highlight=False)


@command(
    ckpt_app,
    name="inspect",
    help="Show what a checkpoint holds: step, layout, recipe, world, probe and every tensor (reads the manifest only;"
    " --verify also hashes every file, exit 1 on any problem)."
    + examples(
        "moectl ckpt inspect runs/tiny/checkpoints",
        "moectl ckpt inspect runs/tiny/checkpoints/step_00000100 --json",
        "moectl ckpt inspect runs/tiny/checkpoints --verify",
    ),
)
def inspect_command(
    ckpt: CkptArg,
    json_: JsonFlag = False,
    verify: Annotated[bool, typer.Option("--verify", help="Also check every file's sha256 and header.")] = False,
) -> None:
    from ckpt.inspect import inspect_checkpoint

    try:
        summary = inspect_checkpoint(ckpt, verify=verify)
    except MoectlError as e:  # unreadable (damaged, missing, not ours to read): a --json reader still gets JSON
        if json_:
            typer.echo(json.dumps({"path": str(ckpt), "readable": False, "problems": [e.one_line()]}, indent=2))
        raise
    if json_:
        typer.echo(json.dumps(summary.to_json(), indent=2))
    else:
        _print_summary(summary, make_console())
    if summary.problems:
        raise typer.Exit(1)


def _print_summary(s: Any, console: Console) -> None:
    from ckpt.inspect import format_bytes

    def compact(d: Any) -> str:
        return json.dumps(d, separators=(", ", ": ")) if d else "-"

    bias = f", expert biases {s.expert_bias_layout}" if s.expert_bias_layout else ""
    owners = ", ".join(f"{k} {v}" for k, v in s.world["owners"].items())
    rows = [
        ("checkpoint", s.path),
        ("step", f"{s.step} ({s.consumed_samples} samples consumed)"),
        ("layout", f"{s.expert_layout}{bias}, glu_interleave_size {s.glu_interleave_size}"),
        ("recipe", compact(s.recipe)),
        ("world", f"dp {s.world['dp']}, ep {s.world['ep']}; owners {owners or '-'}"),
        ("probe", compact(s.probe)),
        ("writer", ", ".join(f"{k} {v}" for k, v in s.writer.items())),
    ]
    for label, text in rows:
        console.print(f"[bold]{label:10}[/] {text}", highlight=False, soft_wrap=True)
    # the role is in the name's suffix; the file without its extension; only names may wrap
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("tensor", overflow="fold")
    for col in ("dtype", "shape", "size", "file"):
        table.add_column(col, no_wrap=True, justify="right" if col == "size" else "left")
    for r in s.tensors:
        shape = "x".join(map(str, r.shape)) or "scalar"
        table.add_row(r.name, r.dtype, shape, format_bytes(r.nbytes), r.file.removesuffix(".safetensors"))
    console.print(table)
    t = s.totals
    roles = ", ".join(f"{role} {v['tensors']} ({format_bytes(v['bytes'])})" for role, v in t["by_role"].items())
    console.print(f"[bold]total[/]      {t['tensors']} tensors, {t['parameters']:,} model parameters, "
                  f"{format_bytes(t['file_bytes'])} in {t['files']} files; {roles}", highlight=False)  # fmt: skip
    if s.problems is not None:
        for p in s.problems:
            console.print(f"[red]problem[/]    {p}", highlight=False)
        console.print("[green]verified: intact[/]" if not s.problems else f"[red]{len(s.problems)} problem(s)[/]")


@command(
    ckpt_app,
    name="export-hf",
    stoppable=True,
    help="Write a checkpoint's model weights as a Hugging Face model folder (config.json + safetensors) that"
    " transformers loads with from_pretrained. Refuses, naming each setting, what the format cannot express."
    + examples(
        "moectl ckpt export-hf runs/qwen/checkpoints /tmp/qwen-hf --format qwen3-moe   # README's qwen run",
        "moectl ckpt export-hf runs/mix/checkpoints/step_00001000 /tmp/mix-hf --format mixtral   # a run with "
        "moe.router_norm_topk_prob=true",
    ),
)
def export_hf_command(
    ckpt: CkptArg,
    dst: NewDirArg,
    format: Annotated[HFFormat, typer.Option("--format", show_default=False,
                                             help="HF architecture to write; the run's config must match it "
                                                  "(mixtral: moe.router_norm_topk_prob=true; qwen3-moe: "
                                                  "model.qk_layernorm=true; refusals name each setting).")],
) -> None:
    from ckpt.hf import export_hf

    out = export_hf(ckpt, dst, format.value)
    make_console().print(f"[green]exported[/] {ckpt} -> {out} ({format.value})", highlight=False)


@command(
    ckpt_app,
    name="import-hf",
    stoppable=True,
    help="Import a Hugging Face Mixtral or Qwen3-MoE folder (per-expert or transformers-v5 fused experts) as a"
    " moectl checkpoint at step 0 (model weights only), and write DST/config.yaml, the moectl config to train or"
    " validate it with. The architecture comes from SRC/config.json (no moectl config needed); --config and"
    " --set give the rest (data, expert layout, interleave, training settings) and may not contradict it. The"
    " probe loss `ckpt validate` checks is computed on a model built in this process (--no-probe skips it)."
    + examples(
        "moectl ckpt import-hf ~/models/Qwen3-30B-A3B runs/qwen/checkpoints",
        "moectl train runs/qwen/checkpoints/config.yaml --set train.train_iters=100",
        "moectl ckpt import-hf ~/models/mixtral runs/mixtral/checkpoints --set data.source=megatron"
        " --set data.path=/data/wiki_text_document",
        "moectl ckpt import-hf ~/models/qwen3-moe /tmp/ck --set moe.single_grouped_weight=false"
        " --set moe.glu_interleave_size=32",
    ),
)
def import_hf_command(
    src: Annotated[Path, typer.Argument(help="HF model folder: config.json + *.safetensors.", show_default=False)],
    dst: NewDirArg,
    config: Annotated[
        Optional[Path], typer.Option("--config", "-c", help="YAML config for everything config.json does not fix.")
    ] = None,
    set_: SetOpt = None,
    no_probe: Annotated[
        bool, typer.Option("--no-probe", help="Record no probe loss (no model is built; validate then fails "
                                               "its probe check).")
    ] = False,
) -> None:
    from ckpt.hf import import_hf
    from moectl.core.config.load import apply_overrides, read_yaml

    probe = None
    if not no_probe:
        from trainer.validation import probe_loss_of_weights as probe

    from moectl.cli.train import refuse_on_rule_errors
    from moectl.core.rules import default_world_size

    base = apply_overrides(read_yaml(config) if config is not None else {}, set_ or [])
    console = make_console()
    out = import_hf(src, dst, base=base, probe=probe,
                    check_config=lambda cfg: refuse_on_rule_errors(cfg, default_world_size(cfg), console,
                                                                   "nothing imported", this_machine=False))
    console.print(f"[green]imported[/] {src} -> {out}", highlight=False)
    console.print(f"config: {out.parent / 'config.yaml'} (moectl train / ckpt validate --config)", highlight=False)


def _ruled(resolve: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    """`resolve` (the checkpoint's config with the user's --config/--set), refused with the rule errors `train`
    would print for it at this world size that the checkpoint's own config does not raise too, or with a model
    other than the saved one (exit 2: the command's fault, not the checkpoint's). Those the saved config raises
    itself (a saved ep=2 checked in one process, an empty `checkpoint.load` an older run recorded) are
    validate's own business: it restores with its own load path and says which layout fits this world. Rules
    about this machine (`rules.check_elsewhere`) are left out."""

    def checked(saved: dict[str, Any]) -> Any:
        import copy

        from ckpt.logical import check_architecture
        from moectl.cli.validate import print_violations
        from moectl.core.config import config_from_dict
        from moectl.core.errors import CheckpointError
        from moectl.core.rules import check_elsewhere

        def errors_of(c: Any) -> list[Any]:
            return [v for v in check_elsewhere(c, int(os.environ.get("WORLD_SIZE", "1"))) if v.severity == "error"]

        recorded = copy.deepcopy(saved)  # `resolve` applies the overrides to the dict it is given
        own = {(v.rule, v.message) for v in errors_of(config_from_dict(copy.deepcopy(recorded)))}
        cfg = resolve(saved)
        try:  # another model than the one saved: the override's fault, not the checkpoint's ("invalid" before)
            check_architecture(recorded, cfg)
        except CheckpointError as e:
            raise UsageError(f"{e.message}, because of --set/--config", "drop the keys named: validate restores "
                             "the checkpoint's own model (in another expert layout or world size, if asked)") from None
        errors = [v for v in errors_of(cfg) if (v.rule, v.message) not in own]
        if errors:
            if int(os.environ.get("RANK", "0")) == 0:
                print_violations(errors, make_console(), lines=True)
            raise UsageError(f"the config to validate with breaks {len(errors)} rule(s) "
                             f"({', '.join(v.rule for v in errors)}); not validating",
                             "fix each --set/--config value above, or drop it to validate with the checkpoint's own")
        return cfg

    return checked


@command(
    ckpt_app,
    name="validate",
    help="Prove a checkpoint restores: integrity (sha256, headers, tensor set), then restore into a live model "
    "and optimizer built from its own config (or --config/--set: other layout, other world size under torchrun), "
    "then check every fp32 master and moment bit for bit, every param and every saved weight against its "
    "master, and the probe loss. "
    "Exit 0 valid, 1 invalid (a checkpoints folder with no step committed yet too), 2 bad usage (a path that does "
    "not exist or is no checkpoint: a file, a run folder, a Hugging Face model folder, a folder with no step folder "
    "in it; a bad --set, a saved layout this world cannot take)."
    + examples(
        "moectl ckpt validate runs/tiny/checkpoints",
        "moectl ckpt validate runs/tiny/checkpoints/step_00000150 --set moe.single_grouped_weight=false",
        "torchrun --nproc-per-node 2 -m moectl ckpt validate runs/tiny/checkpoints",
    ),
)
def validate_command(
    path: CkptArg,
    config: Annotated[
        Optional[Path], typer.Option("--config", "-c", help="Build the model from this config instead of the checkpoint's.")
    ] = None,
    set_: SetOpt = None,
    show_passed: Annotated[bool, typer.Option("--all", help="List passing tensors too, not only failures.")] = False,
) -> None:
    from moectl.core.config.load import load_config, overridden
    from trainer.validation import merge_ranks, validate_checkpoint

    overrides = list(set_ or [])
    given = None if config is None else load_config(config, overrides)  # a bad --config fails here, in one line
    resolve = overridden(overrides) if given is None else lambda saved: given
    if given is not None or overrides:  # the user's config: train's rules first (a --set router_topk=9 was a traceback)
        resolve = _ruled(resolve)
    report = merge_ranks(validate_checkpoint(path, resolve))
    if int(os.environ.get("RANK", "0")) != 0:
        raise typer.Exit(0 if report.ok else 1)
    console = make_console()
    table = Table(title=f"ckpt validate {report.path}", box=box.SIMPLE_HEAD)
    for col in ("stage", "tensor", "result", "detail"):
        table.add_column(col)
    shown = report.checks if show_passed else [c for c in report.checks if not c.ok or c.name == "-"]
    for c in shown:
        table.add_row(c.stage, c.name, "[green]ok[/]" if c.ok else "[red]FAIL[/]", c.detail)
    console.print(table)
    counts = ", ".join(f"{n} {stage}" for stage, n in report.counts.items())
    failed = report.failures()
    if failed:
        console.print(f"[red]invalid[/]: {len(failed)} check(s) failed ({counts} checked)")
        raise typer.Exit(1)
    console.print(f"[green]valid[/]: {counts} checked")
