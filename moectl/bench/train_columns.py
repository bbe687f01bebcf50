"""The columns of `bench train`: the same config run three ways, side by side.

    ours               the config as given (the trainer's defaults for it: on CUDA regional compile and fused
                       fp32 weight-grad accumulation included)
    compiled-peer      each layer's norms, attention core and router under regional torch.compile
                       (`train.compile=regional`, trainer/compile.py), experts as ours run them, weight grads
                       through autograd (`parallel.gradient_accumulation_fusion=false`): what a user who wraps
                       our model in torch.compile gets from a plain engine - the peer issue 14 measured
    torchtitan-recipe  the same with experts on `moe.backend=grouped` (torch._grouped_mm + eager
                       activation): torchtitan's MoE recipe
    cuda-graph         ours with `train.cuda_graph=true` (each micro-batch replayed from one CUDA graph);
                       asked for by name only, since it needs a static expert input (MOE034)
    eager              ours with `train.cuda_graph=false`: the A/B partner of `ours` where `ours` captures
                       (train.cuda_graph null turns graphs on for bf16 dropless and drop-and-pad configs)
    adam, muon         ours with `optimizer.optimizer` set: Muon's speed against AdamW's in one run (issue 22:
                       `--column adam --column muon`: muon's speed-up is over adam), by name only
The peer columns set `train.cuda_graph=false`: they are what a plain engine gives.

A column is nothing but `--set` overrides applied after the user's, so every column runs the real trainer
and the bench needs no engine API of its own.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    """One way of running the config."""

    name: str
    overrides: tuple[str, ...]
    description: str
    default: bool = True  # in the table when no --column is given


COLUMNS: dict[str, Column] = {
    c.name: c
    for c in (
        Column("ours", (), "the config as given"),
        Column(
            "compiled-peer",
            ("train.compile=regional", "parallel.gradient_accumulation_fusion=false", "train.cuda_graph=false"),
            "regional torch.compile, our experts, autograd weight grads",
        ),
        Column(
            "torchtitan-recipe",
            ("train.compile=regional", "parallel.gradient_accumulation_fusion=false", "moe.backend=grouped",
             "train.cuda_graph=false"),
            "regional torch.compile, grouped experts, autograd weight grads",
        ),
        Column("cuda-graph", ("train.cuda_graph=true",), "ours, micro-batches replayed from a CUDA graph", False),
        Column("eager", ("train.cuda_graph=false",), "ours, every micro-batch launched eagerly", False),
        Column("adam", ("optimizer.optimizer=adam",), "ours, AdamW for every param", False),
        Column("muon", ("optimizer.optimizer=muon",), "ours, Muon for the matrices (AdamW for the rest)", False),
    )
}


def pick(names: list[str] | None) -> list[Column]:
    """The named columns in table order (the default ones for None); unknown names raise ValueError."""
    if not names:
        return [c for c in COLUMNS.values() if c.default]
    unknown = [n for n in names if n not in COLUMNS]
    if unknown:
        # a typo gets its column named, as a mistyped command or config key gets its did-you-mean
        close = [m[0] for n in unknown if (m := difflib.get_close_matches(n, list(COLUMNS), n=1, cutoff=0.6))]
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise ValueError(f"unknown column(s) {unknown}{hint}; choose from {list(COLUMNS)}")
    return [c for c in COLUMNS.values() if c.name in names]
