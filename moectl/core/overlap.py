"""`overlap_policy`: the grad reduce and param gather overlap a run uses, its null defaults resolved.

One function, read by the rules (MOE016, MOE017), the run summary, the train banner and the trainer's
engine, so they never disagree on what a null flag means.
"""

from __future__ import annotations

from moectl.core.config.schema import ParallelConfig


def overlap_policy(p: ParallelConfig, dp: int) -> tuple[bool, bool]:
    """`(overlap_grad_reduce, overlap_param_gather)` as a run of data parallel size `dp` uses them: each the
    value set, else null's choice: on under data parallelism, where overlap is what makes dp scale (dp=4 on
    H100s, reference config: 0.938x of one GPU per GPU without, 0.978x with, docs/benchmarks.md seventeenth
    session), the gather only with the distributed optimizer (nothing else is gathered) and the overlapped
    reduce (its hooks drive it, MOE016). A set param gather turns a null reduce on."""
    grad = p.overlap_grad_reduce if p.overlap_grad_reduce is not None else (dp > 1 or p.overlap_param_gather is True)
    gather = (p.overlap_param_gather if p.overlap_param_gather is not None
              else dp > 1 and grad and p.use_distributed_optimizer)  # fmt: skip
    return grad, gather


def describe_overlap(p: ParallelConfig, dp: int) -> str:
    """What a run of data parallel size `dp` overlaps, saying when a null chose it:
    "grad reduce on, param gather on (null flags: the default at dp=2)"."""
    grad, gather = overlap_policy(p, dp)
    null = f" (null flags: the default at dp={dp})" if None in (p.overlap_grad_reduce, p.overlap_param_gather) else ""
    return f"grad reduce {'on' if grad else 'off'}, param gather {'on' if gather else 'off'}{null}"
