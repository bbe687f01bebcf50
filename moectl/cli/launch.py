"""`--nproc-per-node N`: start N local processes through torch's own elastic launcher.

We do not hand-roll process management: `torch.distributed.run` (torchrun) gives rendezvous, per-rank
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), log prefixes and "one rank died, stop
the others". Multi-node runs use torchrun directly:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m moectl train CONFIG
"""

from __future__ import annotations

import os
import sys


def under_torchrun() -> bool:
    """True inside a process that torchrun (or this launcher) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launch_local(nproc_per_node: int, moectl_args: list[str]) -> int:
    """Run `python -m moectl <moectl_args>` in `nproc_per_node` local processes; returns the exit code."""
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc_per_node}", "--module", "moectl", *moectl_args]
    )
    try:
        run(args)
    except Exception as e:  # ChildFailedError: torchrun already printed each failed rank's error
        name = type(e).__name__
        if name == "ChildFailedError":
            return 1
        raise
    return 0


def reexec_args() -> list[str]:
    """This process's moectl arguments without `--nproc-per-node`, for the children."""
    out, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if arg in ("--nproc-per-node", "--nproc_per_node"):
            skip = True
            continue
        if arg.startswith(("--nproc-per-node=", "--nproc_per_node=")):
            continue
        out.append(arg)
    return out
