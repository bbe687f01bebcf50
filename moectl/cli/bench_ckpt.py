"""`moectl bench ckpt CONFIG`: checkpoint save (synchronous and background), validate, convert and inspect
--verify, each beside the plain reads and writes of the same bytes on the same disk."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from moectl.cli.console import make_console
from rich.table import Table

from moectl.cli.base import command, data_errors_are_usage
from moectl.cli.bench import bench_app
from moectl.cli.options import ConfigArg, JsonPathOpt, NprocOpt, SetOpt, examples
from moectl.cli.output import write_json_file

_HELP = (
    "Checkpoint speed at the config's model size: builds the model and optimizer (one training step), saves it "
    "synchronously and in the background (blocking and total time, twice: the first background save allocates "
    "its host buffers, the second reuses them), writes the same bytes with a plain sequential writer to the "
    "same folder (the floor), then times `ckpt inspect --verify`, `ckpt convert` and `ckpt validate` against "
    "raw reads (and for convert, a raw copy) of the same bytes from a cold page cache."
    + examples(
        "moectl bench ckpt configs/bench_reference.yaml --json runs/bench_ckpt.json",
        "moectl bench ckpt configs/bench_reference.yaml --nproc-per-node 2 --dir /nvme/bench",
        "moectl bench ckpt configs/tiny.yaml --quick",
    )
)


def render(result: Any, console: Console) -> None:
    """The result as one Rich table: a row per measure, with its floor and the ratio to it."""
    meta = result.meta
    model = meta.get("model", {})
    host = meta.get("host", {})
    fs = host.get("filesystem", {})
    title = (
        f"checkpoint I/O, {meta['config']}: {model.get('params', 0) / 1e6:,.1f}M params, "
        f"{meta.get('checkpoint_bytes', 0) / 1e9:.2f} GB in {meta.get('files', 0)} files, {meta['world_size']} x "
        f"{meta['device_name']} (torch {meta['torch']})"
    )
    caption = (
        f"folder {meta['folder']} ({fs.get('type', '?')} on {fs.get('device', '?')}); {host.get('cpus_usable', '?')} "
        f"CPUs, load average {host.get('load_average', '?')}; seconds are the slowest rank's; reads start from a "
        f"cold page cache" + ("" if meta.get("page_cache_dropped", True) else " (NOT: it could not be dropped)")
        + "".join(f"\n{n}" for n in result.notes)
    )
    table = Table(title=title, caption=caption)
    for col, justify in (("measure", "left"), ("seconds", "right"), ("GB/s", "right"), ("floor", "left"),
                         ("floor s", "right"), ("/ floor", "right")):  # fmt: skip
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in result.rows:
        table.add_row(
            r["measure"], f"{r['seconds']:.3f}", "-" if r["gb_per_s"] is None else f"{r['gb_per_s']:.2f}",
            r["floor"] or "", "" if r["floor_seconds"] is None else f"{r['floor_seconds']:.3f}",
            "" if r["vs_floor"] is None else f"{r['vs_floor']:.2f}x",
        )  # fmt: skip
    console.print(table)


@command(bench_app, name="ckpt", help=_HELP, interruptible=True)
def ckpt(
    config: ConfigArg,
    set_: SetOpt = None,
    nproc_per_node: NprocOpt = 1,
    folder: Annotated[
        Optional[Path], typer.Option("--dir", help="Where to write (default: RUN_DIR/bench_ckpt of the config); "
                                     "removed afterwards unless --keep, and by a run that is interrupted or "
                                     "fails (a folder that was there is emptied, not removed); a folder holding "
                                     "files the bench did not write is refused.")
    ] = None,
    keep: Annotated[bool, typer.Option("--keep", help="Leave the synchronous save in --dir (of a run that "
                                       "finishes).")] = False,
    json_path: JsonPathOpt = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="The config's structure shrunk to a tiny CPU model: a CI smoke test.")
    ] = False,
    saves_only: Annotated[
        bool, typer.Option("--saves-only", help="Measure the saves and the plain writer only (no inspect, convert, "
                           "validate or raw reads): the cheap rows of a table across sizes and rank counts.")
    ] = False,
) -> None:
    from moectl.bench import ckpt_bench as cb
    from moectl.cli.launch import launch_local, reexec_args, under_torchrun
    from moectl.cli.train import refuse_configs_once

    world = int(os.environ.get("WORLD_SIZE", "1")) if under_torchrun() else nproc_per_node
    rank0 = int(os.environ.get("RANK", "0")) == 0
    console = make_console(quiet=not rank0)
    bench = cb.CkptBenchConfig(config=config, sets=list(set_ or []), folder=folder, quick=quick, keep=keep,
                                saves_only=saves_only)
    # Before any process starts, as `train` does: the bench replaces its folder, so one holding the user's files
    # is refused here; a config that breaks a rule was one error line per worker, after torchrun's start-up.
    # The launcher's workers check again, silently.
    cb.check_folder(cb.bench_folder(bench))
    cfg = cb.bench_config(bench, world)
    refuse_configs_once([cfg], world, rank0)
    if nproc_per_node > 1 and not under_torchrun():
        raise typer.Exit(launch_local(nproc_per_node, reexec_args()))

    import torch

    from trainer.parallel.groups import destroy_distributed
    from trainer.runtime import pick_device

    device = pick_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", "0")))
    meta: dict[str, Any] = {
        "config": str(config), "sets": bench.sets, "quick": quick, "saves_only": saves_only,
        "folder": str(Path(cfg.run_dir).parent),
        "world_size": world, "device": device.type, "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "host": cb.host_meta(Path(cfg.run_dir).parent),
    }  # fmt: skip
    try:
        with data_errors_are_usage():
            result = cb.run(bench, cfg, meta, lambda line: console.print(line, style="dim", highlight=False))
    finally:
        if world > 1:
            destroy_distributed()
    if rank0:
        render(result, console)
        if json_path is not None:
            write_json_file(json_path, result.to_json())
            console.print(f"wrote {json_path}")
