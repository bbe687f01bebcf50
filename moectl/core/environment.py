"""Every `MOECTL_*` environment variable moectl reads, in one table, and the check that names an unknown one.

A mistyped variable (`MOECTL_TRITON_ROPE` with a letter too many) would otherwise change nothing without a
word, so every command warns about a `MOECTL_*` name it does not know, with the closest known one
(moectl/cli/base.py). A test keeps the table and the code in step both ways. The A/B switches (`=0` turns
one fast path off, `trainer/switches.py`) exist for comparisons; a run needs none of them.
"""

from __future__ import annotations

import difflib
from typing import Mapping

_SWITCH = "A/B switch: =0 turns off "
_NS_TILES = "tile config override w,s,k[,n] of a Newton-Schulz kernel (the sweep probe's): "

ENV: dict[str, str] = {
    # user-facing
    "MOECTL_DEBUG": "=1 adds Python tracebacks above the one-line errors, and shows torchrun's own logs",
    "MOECTL_CACHE_DIR": "where built corpus streams are cached (else $XDG_CACHE_HOME/moectl, else ~/.cache/moectl)",
    "MOECTL_CKPT_THREADS": "threads for a checkpoint's I/O and hashing (else this process's share of the CPUs)",
    "MOECTL_COMPILE_BACKEND": "the torch.compile backend of train.compile (default inductor)",
    # internal: set by moectl for its own processes, or by its tests
    "MOECTL_OUTCOME_DIR": "internal: where the launcher's workers report how they ended",
    "MOECTL_LAUNCHED": "internal: set for the workers of moectl's own launcher (--nproc-per-node)",
    "MOECTL_LAUNCHER_PID": "internal: that launcher's process id (a worker stops when it dies)",
    "MOECTL_PARITY_VERDICT": "internal: where a parity run's worker writes its verdict",
    "MOECTL_CKPT_FAIL": "tests: fault injection into checkpoint saves (<rank>:<phase>[:<how>][@<step>])",
    # A/B switches
    "MOECTL_GRAD_SQ": _SWITCH + "the expert grads' sums of squares left by their wgrad kernel for the grad norm",
    "MOECTL_TRITON_ADAMW": _SWITCH + "the Triton AdamW of the distributed optimizer",
    "MOECTL_TRITON_CROSS_ENTROPY": _SWITCH + "the Triton cross-entropy op of the loss",
    "MOECTL_TRITON_EMBEDDING_GRAD": _SWITCH + "the embedding's weight grad straight into main_grad",
    "MOECTL_TRITON_GATHER_SUM": _SWITCH + "the Triton gather-and-sum of the MoE combine",
    "MOECTL_TRITON_NS": _SWITCH + "Muon's Triton Newton-Schulz GEMMs (cuBLAS instead)",
    "MOECTL_TRITON_QUANTIZE": _SWITCH + "the Triton fp8/mxfp8 quantize kernels",
    "MOECTL_TRITON_ROPE": _SWITCH + "the RoPE + qkv split op of the attention",
    "MOECTL_TRITON_SORT": _SWITCH + "the Triton counting sort of tokens by expert",
    "MOECTL_TRITON_SPLIT3": _SWITCH + "the Triton split of the router's operands",
    "MOECTL_TRITON_TOPK": _SWITCH + "the router's Triton top-k",
    "MOECTL_QUANT_TMA": _SWITCH + "TMA loads in the quantize kernels",
    "MOECTL_NS_TMA": _SWITCH + "TMA loads in Muon's Newton-Schulz kernels",
    "MOECTL_NS_GRAM2": _SWITCH + "two row tiles per Newton-Schulz Gram program",
    "MOECTL_NS_BX": "who multiplies B into X in Muon's Newton-Schulz step: cublas (default) or triton",
    "MOECTL_MUON_OVERLAP": _SWITCH + "Muon's elementwise passes on a side stream",
    "MOECTL_MUON_DEVICE_VERDICT": _SWITCH + "Muon's skip-step verdict left on the device",
    "MOECTL_PUBLISH": _SWITCH + "optimizers writing the new bf16 params themselves",
    "MOECTL_STALE_GRADS": _SWITCH + "stale-flagged expert grads (every grad zero-filled instead)",
    "MOECTL_FUSED_OVERLAP_WGRAD": _SWITCH + "the fused expert MLP's weight grads on a second stream",
    "MOECTL_GRAPH_GRAD_SYNC": _SWITCH + "grad reduce-scatters launched between graph replays",
    "MOECTL_GRAPH_PARAM_GATHER": _SWITCH + "param all-gathers inside the graphed step",
    # probes' tile sweeps
    "MOECTL_NS_GRAM": _NS_TILES + "the Gram kernel",
    "MOECTL_NS_GRAM_TMA": _NS_TILES + "the TMA Gram kernel",
    "MOECTL_NS_GRAM2_TMA": _NS_TILES + "the two-row TMA Gram kernel",
    "MOECTL_NS_AXPBY": _NS_TILES + "the B X kernel",
    "MOECTL_NS_AXPBY_TMA": _NS_TILES + "the TMA B X kernel",
}


LAUNCHED_ENV = "MOECTL_LAUNCHED"


def says_it_once(environ: Mapping[str, str]) -> bool:
    """Whether this process should print a once-per-command notice: not a worker of moectl's own launcher
    (which printed it), not a rank other than 0 (torchrun run by hand)."""
    return environ.get(LAUNCHED_ENV) is None and environ.get("RANK") in (None, "0")


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One line per `MOECTL_*` name in `environ` that moectl does not read, with the closest known name."""
    lines = []
    for name in sorted(n for n in environ if n.startswith("MOECTL_") and n not in ENV):
        close = difflib.get_close_matches(name, list(ENV), n=1, cutoff=0.8)
        hint = f"did you mean {close[0]}?" if close else "moectl reads no such variable"
        lines.append(f"environment variable {name} is not one of moectl's ({hint}); it changes nothing")
    return lines
