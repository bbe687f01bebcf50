"""`moectl parity`: does a flag change training? The config run twice, OFF as written and ON with the flags.

Every seed bug of this project was found by one comparison: the same config, data and seed with a flag ON
against OFF, step by step. This is that comparison, for any flag:

- Both runs are built in this process (each rank, under torchrun) and stepped in lockstep: step k of OFF,
  then step k of ON, then the comparison, so no per-step state is stored. Each run keeps its own global RNG
  state (torch, CUDA, Python's `random`), saved and restored around its steps, so a run sees exactly the
  random stream it would see alone. Memory: two models and optimizers at once.
- After every step it compares the loss, the grad norm, and every tensor of the engine's logical state
  (`Engine.logical_state`: params, fp32 masters, optimizer moments), made layout-free first: expert tensors
  gathered over expert parallelism and normalised to the single-grouped layout with contiguous `[gate; up]`
  fc1 rows (`ckpt.layout`, the loader's own normalisation), so a flag that changes the expert layout, the
  fc1 interleave or the ep size compares name by name. Reading the logical state finishes deferred param
  gathers, as an evaluation does (train-eval-train equals train bitwise: tests/acceptance).
- Bitwise by default (bytes, so equal NaNs are equal); with `rtol` a scalar differs when
  |on - off| > rtol * |off|, a tensor when max |on - off| > rtol * max |off| (scaled by the tensor, so
  entries near zero do not decide alone).
- Per step it records both runs' loss, grad norm and sha256 digests of their params, masters and optimizer
  state; the report names the first step and the first tensor that differ (loss, then grad norm, then
  tensors by name: params, masters, optimizer state).

Only the training steps are compared: no evaluation, no checkpoint is written (`checkpoint.save_interval`
is cleared), nothing is written to `run_dir`.
"""

from __future__ import annotations

import copy
import hashlib
import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch

from ckpt.layout import SINGLE_GROUPED, normalize_for_model
from ckpt.logical import STATE_SUFFIX, flatten_state, globalize
from moectl.core.config.schema import Config
from moectl.core.errors import ConfigError
from moectl.core.params import count_params
from trainer.loop import Trainer
from trainer.observer import SilentObserver

KIND_OF_SUFFIX = {suffix: key for key, suffix in STATE_SUFFIX.items()}
DIGEST_GROUPS = ("params", "masters", "optimizer")


@dataclass
class Difference:
    """One thing that differs at one step: `what` is loss, grad_norm, param, master, or a moment's name."""

    step: int
    what: str
    name: str  # the tensor's layout-free name, '-' for a scalar
    detail: str

    def describe(self) -> str:
        where = f"{self.what} {self.name}" if self.name != "-" else self.what
        return f"step {self.step}: {where} ({self.detail})"


@dataclass
class RunStep:
    """One run's side of a step."""

    loss: float
    grad_norm: float
    skipped: bool
    digests: dict[str, str]  # sha256 of params, masters, optimizer state (layout-free, sorted by name)


@dataclass
class StepRecord:
    step: int
    off: RunStep
    on: RunStep
    differences: list[Difference] = field(default_factory=list)
    compared: int = 0  # tensors compared


@dataclass
class ParityReport:
    """Every step of both runs; `equal` when no step differs."""

    flags: list[str]
    steps: int
    rtol: Optional[float]
    records: list[StepRecord] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return all(not r.differences for r in self.records)

    @property
    def first(self) -> Optional[Difference]:
        """The first difference: the earliest step's first item in comparison order."""
        for r in self.records:
            if r.differences:
                return r.differences[0]
        return None

    @property
    def mode(self) -> str:
        return "bitwise" if self.rtol is None else f"rtol {self.rtol:g}"

    def to_json(self) -> dict[str, Any]:
        first = self.first
        return {
            "flags": self.flags, "steps": self.steps, "rtol": self.rtol, "mode": self.mode, "equal": self.equal,
            "first_difference": asdict(first) if first is not None else None,
            "records": [
                {"step": r.step, "off": asdict(r.off), "on": asdict(r.on), "tensors_compared": r.compared,
                 "differences": [asdict(d) for d in r.differences]}
                for r in self.records
            ],
        }  # fmt: skip


# ------------------------------------------------------------------------------------------------ comparing
def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaNs with the same bits are equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bytes(a), _bytes(b))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def compare_scalar(off: float, on: float, rtol: Optional[float]) -> Optional[str]:
    """None when equal (exactly, or within `rtol` of `off`), else what differs."""
    if off == on or (math.isnan(off) and math.isnan(on)):
        return None
    finite = math.isfinite(off) and math.isfinite(on)
    if rtol is not None and finite and abs(on - off) <= rtol * abs(off):
        return None
    rel = abs(on - off) / abs(off) if finite and off != 0 else math.inf
    return f"off {off!r}, on {on!r}, relative {rel:.3e}"


def compare_tensor(off: torch.Tensor, on: torch.Tensor, rtol: Optional[float]) -> Optional[str]:
    """None when equal (bitwise, or max |on - off| <= rtol * max |off|), else what differs. Non-finite
    entries must sit at the same places with the same values either way."""
    if off.shape != on.shape:
        return f"shape off {list(off.shape)}, on {list(on.shape)}"
    if rtol is None:
        if off.dtype != on.dtype:
            return f"dtype off {off.dtype}, on {on.dtype}"
        if bitwise_equal(off, on):
            return None
    a, b = off.detach().double(), on.detach().double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    keep = dict(nan=0.0, posinf=math.inf, neginf=-math.inf)
    if not torch.equal(fa, fb) or not torch.equal(a[~fa].nan_to_num(**keep), b[~fb].nan_to_num(**keep)):
        return f"non-finite values differ ({int((~fa).sum())} off, {int((~fb).sum())} on)"
    a, b = a[fa], b[fb]
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    scale = a.abs().max().item() if a.numel() else 0.0
    if rtol is not None and diff <= rtol * scale:
        return None
    n = int((a != b).sum())
    if n == 0:
        return "equal values in other bits (signed zeros or NaN payloads)"
    rel = diff / scale if scale else math.inf
    return f"max |diff| {diff:.3e} (max |off| {scale:.3e}, relative {rel:.3e}), {n} of {off.numel()} elements"


def kind_of(name: str) -> str:
    """param, master, or the optimizer state's key, from a flat state name's suffix."""
    for suffix, key in KIND_OF_SUFFIX.items():
        if name.endswith(suffix):
            return key
    return "param"


def _digest_group(kind: str) -> str:
    return "params" if kind == "param" else "masters" if kind == "master" else "optimizer"


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 per group (params, masters, optimizer state) over names, dtypes, shapes and bytes, by name."""
    hashes = {g: hashlib.sha256() for g in DIGEST_GROUPS}
    for name in sorted(tensors):
        t = tensors[name]
        h = hashes[_digest_group(kind_of(name))]
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(_bytes(t.cpu()).numpy().tobytes())
    return {g: h.hexdigest() for g, h in hashes.items()}


def layout_free_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The engine's logical state as flat names, experts of every ep rank, single grouped, `[gate; up]` fc1.

    A collective (param sync, optimizer gather, expert all-gather): every rank calls it.
    """
    cfg, pstate = trainer.cfg, trainer.rt.pstate
    local = flatten_state(trainer.engine.logical_state())
    tensors = globalize(local, pstate.ep if pstate is not None else None, cfg.moe.num_experts)
    return normalize_for_model(
        {n: t.detach().cpu() for n, t in tensors.items()}, num_experts=cfg.moe.num_experts,
        target_layout=SINGLE_GROUPED, target_bias_layout=SINGLE_GROUPED,
        source_interleave=cfg.moe.glu_interleave_size, target_interleave=None, ffn_size=cfg.moe.ffn_hidden_size,
    )  # fmt: skip


def _order(name: str) -> tuple[int, str]:
    """Comparison order: params, then masters, then optimizer state; by name within each."""
    kind = kind_of(name)
    return ({"param": 0, "master": 1}.get(kind, 2), name)


def compare_states(step: int, off: dict[str, torch.Tensor], on: dict[str, torch.Tensor],
                   rtol: Optional[float]) -> list[Difference]:  # fmt: skip
    """Every tensor that differs, in comparison order; names present on one side only come first."""
    out = [Difference(step, kind_of(n), n, "only in the OFF run" if n in off else "only in the ON run")
           for n in sorted(off.keys() ^ on.keys(), key=_order)]  # fmt: skip
    for name in sorted(off.keys() & on.keys(), key=_order):
        why = compare_tensor(off[name], on[name], rtol)
        if why is not None:
            out.append(Difference(step, kind_of(name), name, why))
    return out


# ------------------------------------------------------------------------------------------------ running
class _Run:
    """One side: its Trainer and its own global RNG state between its steps."""

    def __init__(self, cfg: Config) -> None:
        self.trainer = Trainer(cfg, SilentObserver())  # seeds the global RNGs, as a run's start does
        self._rng = _rng_state()

    def step(self, step: int) -> dict[str, Any]:
        _set_rng_state(self._rng)
        try:
            return self.trainer.train_step(step)
        finally:
            self._rng = _rng_state()


def _same_parameters(off_cfg: Config, on_cfg: Config, flags: Optional[list[str]]) -> None:
    """Refuse, before anything is built, flags that change the model's parameters (`moe.num_experts=8` ran both
    models and reported "different" at step 1's loss): parity compares one model run two ways. The counts by kind
    (torch-free) tell it; the expert layout, dtypes and top-k leave them alone."""
    counts = [asdict(count_params(c.model, c.moe)) for c in (off_cfg, on_cfg)]
    changed = [f"{kind.replace('_', ' ')} {counts[0][kind]:,} off, {counts[1][kind]:,} on" for kind in counts[0]
               if kind != "topk_fraction" and counts[0][kind] != counts[1][kind]]  # fmt: skip
    if changed:
        raise ConfigError("--flag", " ".join(flags or []), f"changes the model's parameters ({'; '.join(changed)})",
                          "parity compares one model run two ways: flag what keeps the parameters (layouts, "
                          "precision, overlap, backends, kernels), or compare the two configs' losses instead")


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # not a new context for a CPU run
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def prepare(cfg: Config, steps: int) -> Config:
    """A private copy of `cfg` for a parity side: no checkpoint saving (nothing is written)."""
    if steps < 1:
        raise ConfigError("--steps", steps, "must be at least 1", "pass --steps 1 or more")
    if steps > cfg.train.train_iters:
        raise ConfigError(
            "--steps", steps, f"exceeds train.train_iters={cfg.train.train_iters} (the LR schedule's length)",
            f"pass --steps {cfg.train.train_iters} or less, or --set train.train_iters={steps}",
        )  # fmt: skip
    cfg = copy.deepcopy(cfg)
    cfg.checkpoint.save_interval = None
    return cfg


def run_parity(off_cfg: Config, on_cfg: Config, steps: int, *, flags: Optional[list[str]] = None,
               rtol: Optional[float] = None,
               on_step: Optional[Callable[[StepRecord], None]] = None) -> ParityReport:  # fmt: skip
    """Run OFF and ON in lockstep for `steps` steps and compare them after each (see the module docstring).

    Collective under torchrun: every rank calls it and gets the same report. `on_step` sees each record as
    it is made (progress output).
    """
    if rtol is not None and not (rtol >= 0 and math.isfinite(rtol)):
        raise ConfigError("--rtol", rtol, "must be a finite number >= 0", "pass e.g. --rtol 1e-6, or omit it for bitwise")
    _same_parameters(off_cfg, on_cfg, flags)
    runs = [_Run(prepare(off_cfg, steps)), _Run(prepare(on_cfg, steps))]
    report = ParityReport(list(flags or []), steps, rtol)
    for step in range(steps):
        results, states = [], []
        for run in runs:
            rec = run.step(step)
            state = layout_free_state(run.trainer)
            results.append(RunStep(float(rec["loss"]), float(rec["grad_norm"]), bool(rec["skipped"]), digests(state)))
            states.append(state)
        n = step + 1
        record = StepRecord(n, results[0], results[1], compared=len(states[0].keys() | states[1].keys()))
        for what, a, b in (("loss", results[0].loss, results[1].loss),
                           ("grad_norm", results[0].grad_norm, results[1].grad_norm)):  # fmt: skip
            why = compare_scalar(a, b, rtol)
            if why is not None:
                record.differences.append(Difference(n, what, "-", why))
        record.differences += compare_states(n, states[0], states[1], rtol)
        report.records.append(record)
        if on_step is not None:
            on_step(record)
    return report
