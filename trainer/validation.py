"""`moectl ckpt validate`: prove that what a checkpoint holds comes back into a live model and optimizer.

It lives on the engine's side because it builds a live run (`Trainer`) to restore into.

Three stages, each reported per tensor:
1. integrity: sha256, sizes, safetensors headers, the complete tensor set, and the manifest's own digest
   over every field, run state included (`verify_checkpoint`, ckpt/seal.py; a format 1 manifest, which
   has none, passes with a warning in the row's detail);
2. restore: build the model and optimizer from the checkpoint's own config, or a given one (other expert
   layout, interleave or world size), and load through the same path `train` resumes with;
3. prove: every restored fp32 master equals the checkpoint's (normalised to this model's layout) bit for
   bit, and so do the Adam moments; every model param equals its master cast to the param dtype (a
   quantized param of fp8/fp4 param gather: the recipe's quantization of that cast, bytes and scales); the
   probe batch's loss equals the recorded one - bitwise when layout, recipe and world size are the
   checkpoint's own, else within `PROBE_RTOL`. The probe is what catches a master edited together with
   its sha256: each tensor would still match the (edited) file, but the model no longer computes the
   loss that was recorded when the checkpoint was written.

A model-only checkpoint (no optimizer tensors: `import-hf` writes those), or any checkpoint validated with
`checkpoint.no_load_optim=true`, restores as training from it would: fp32 masters from the model weights,
fresh moments. Stage 3 then proves every restored master is the checkpoint's weight as fp32 and every param
its cast (`weight` rows), reports that there were no masters (or moments) to compare, and checks the probe
as above (`import-hf` records one).
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ckpt.integrity import BackgroundVerify
from ckpt.logical import STATE_SUFFIX, expert_layouts, is_model_only, localize, read_logical, recipe_meta
from ckpt.reader import Checkpoint, open_checkpoint
from ckpt.seal import unsealed_note
from moectl.core.config import config_from_dict
from moectl.core.config.schema import Config
from moectl.core.errors import ConfigError, MoectlError, UsageError
from trainer.checkpointing.resume import load_model_weights
from trainer.distributed.quantized_storage import quantized_storage_of
from trainer.loop import Trainer
from trainer.observer import SilentObserver
from trainer.parallel.groups import ep_sizes

# Builds the config to restore into from the checkpoint's own (plain data, a private copy).
ConfigFor = Callable[[dict[str, Any]], Config]

# Another expert layout or world size changes reduction orders inside the forward (grouped vs stacked
# GEMMs are bitwise equal, but a different world size is not), so the probe then gets a tolerance.
PROBE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclass
class Check:
    """One row of the report."""

    stage: str  # integrity | restore | master | moment | param | weight | probe
    name: str  # tensor or file, or '-' for the whole checkpoint
    ok: bool
    detail: str = ""


@dataclass
class ValidationReport:
    """All checks; `ok` when none failed."""

    path: Path
    checks: list[Check] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, check: Check) -> None:
        self.counts[check.stage] = self.counts.get(check.stage, 0) + 1
        self.checks.append(check)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


def merge_ranks(report: ValidationReport) -> ValidationReport:
    """Every rank's report as one (collective; `report` itself without a multi-rank process group): each rank
    proves the tensors it owns, so rank 0's rows alone could read "valid" while another rank's failed. The
    merge keeps rank 0's rows, adds every other rank's failures with `rank N: ` before their detail, and sums
    each stage's count over the ranks; integrity is rank 0's alone (every rank hashes the same files, so
    another rank's integrity rows repeat rank 0's). Every rank gets the same report, so they agree on the
    verdict and the exit code."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return report
    mine = ([(c.stage, c.name, c.ok, c.detail) for c in report.checks], report.counts)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged = ValidationReport(report.path)
    for rank, (checks, counts) in enumerate(every):
        for stage, name, ok, detail in checks:
            if rank == 0:
                merged.checks.append(Check(stage, name, ok, detail))
            elif not ok and stage != "integrity":
                merged.checks.append(Check(stage, name, ok, f"rank {rank}: {detail}"))
        for stage, n in counts.items():
            if rank == 0 or stage != "integrity":
                merged.counts[stage] = merged.counts.get(stage, 0) + n
    return merged


def validate_checkpoint(path: str | Path, config_for: Optional[ConfigFor] = None) -> ValidationReport:
    """Run all three stages on `path` (a step folder or a checkpoints folder); never raises for a bad checkpoint.

    `config_for` builds the config to restore into from a deep copy of the checkpoint's own (default: that
    config as it is); the proofs compare against the checkpoint's recorded config, which it cannot touch.

    The files are hashed on a thread of their own while the model is built, restored and proved (stage 1
    alongside stages 2 and 3), so each file is read from disk about once and the hashing overlaps the rest;
    if integrity fails, only its rows are reported, as if the later stages had never run.
    """
    verifying = BackgroundVerify(path)
    try:
        later = ValidationReport(Path(path))
        note, ck_path = _restore_and_prove(later, path, config_for)
    finally:
        problems = verifying.problems()  # raises as verify_checkpoint does (a path that is no folder)
    report = ValidationReport(Path(path))
    for p in problems:
        report.add(Check("integrity", p.tensor or p.file or "-", False, f"{p.kind}: {p.message}"))
    if problems:
        return report
    detail = "sha256, sizes, headers, tensor set and the manifest digest (run state)"
    if note:
        detail = f"sha256, sizes, headers and tensor set; warning: {note}"
    report.add(Check("integrity", "-", True, detail))
    report.path = ck_path or report.path
    for c in later.checks:
        report.add(c)
    return report


def _restore_and_prove(report: ValidationReport, path: str | Path, config_for: Optional[ConfigFor]
                       ) -> tuple[Optional[str], Optional[Path]]:  # fmt: skip
    """Stages 2 and 3 into `report`; returns the manifest's unsealed note (None when sealed) and the step folder."""
    try:
        with warnings.catch_warnings():  # the unsealed-manifest warning goes into the integrity row instead
            warnings.simplefilter("ignore")
            ck = open_checkpoint(path, verify=False)  # hashed alongside: see validate_checkpoint
    except MoectlError as e:
        report.add(Check("restore", "-", False, e.one_line()))
        return None, None
    note = unsealed_note(ck.manifest)
    try:
        cfg = (config_for or config_from_dict)(copy.deepcopy(ck.meta["config"]))
        cfg.checkpoint.load = str(ck.path)
        # weights only: what the checkpoint holds (import-hf), or what the user asked for
        weights_only = is_model_only(ck) or cfg.checkpoint.no_load_optim
        cfg.checkpoint.no_load_optim = weights_only
        cfg.checkpoint.load_main_params_from_ckpt = False
        cfg.run_dir = str(ck.path.parent / ".validate")  # never written: validate does not call run()
        with warnings.catch_warnings():  # the restore reopens it: its unsealed-manifest warning is in the row above
            warnings.simplefilter("ignore", UserWarning)
            trainer = Trainer(cfg, SilentObserver(), verify_checkpoint=False, before_load=_compile_probe)
    except ConfigError as e:
        if e.key == "optimizer.optimizer":  # another optimizer asked for: the command's fault, not the checkpoint's
            raise UsageError(e.message, "validate with the checkpoint's own optimizer (drop that --set), or add "
                                        "--set checkpoint.no_load_optim=true to check its weights only") from None
        if not e.key.startswith("parallel."):
            report.add(Check("restore", "-", False, e.one_line()))
            return note, ck.path
        # the saved layout does not fit this world (ep=2 checked in one process): the checkpoint may be fine, the
        # command is not (exit 2, not "invalid"); its state is layout-free, so another layout restores it
        if e.key == "parallel.expert_model_parallel_size":
            # torchrun's world even before the rendezvous (init_distributed checks the size first)
            world = (torch.distributed.get_world_size() if torch.distributed.is_initialized()
                     else int(os.environ.get("WORLD_SIZE", "1")))  # fmt: skip
            change = f"pass --set {e.key}=N, N one of {ep_sizes(world)}"
        else:
            change = f"{e.fix or 'change ' + e.key} (with --set)"
        raise UsageError(f"{e.message}: the checkpoint's recorded layout does not fit this world",
                         f"{change} (the checkpoint restores into any layout), or run ckpt validate under torchrun "
                         "with the saved world size") from None  # fmt: skip
    except UsageError:  # the user's --set/--config refused (`moectl.cli.ckpt`): the command's fault (exit 2)
        raise
    except MoectlError as e:
        report.add(Check("restore", "-", False, e.one_line()))
        return note, ck.path
    report.add(Check("restore", "-", True, f"into {expert_layouts(cfg)[0]} model, world size {trainer.rt.world_size}"))
    if weights_only:
        _prove_weights(report, ck, cfg, trainer)
    else:
        _prove_tensors(report, ck, cfg, trainer)
    _prove_probe(report, ck, cfg, trainer)
    return note, ck.path


def _compile_probe(trainer: Trainer) -> None:
    """Run the probe once before the load, on the not yet loaded (zero) weights, where its forward compiles
    (`train.compile` on CUDA: seconds per region): the compile then overlaps the hashing thread's cold read
    of the files instead of following the load. The probe itself is recomputed after the load; eval keeps
    recipe states untouched, so this run changes nothing it measures."""
    if trainer.compiled_regions:
        trainer.probe_loss()


Tensors = dict[str, torch.Tensor]


def _restored(ck: Checkpoint, cfg: Config, trainer: Trainer
              ) -> tuple[Tensors, dict[str, Tensors], dict[str, torch.nn.Parameter]]:  # fmt: skip
    """What both proofs compare: the checkpoint's tensors for this rank's params (read again, apart from the
    load, and localized to this rank's experts), the engine's restored logical state, and the params."""
    params = dict(trainer.model.named_parameters())
    pstate = trainer.rt.pstate
    expected = localize(read_logical(ck, cfg, wanted=set(params)), pstate.ep if pstate is not None else None,
                        cfg.moe.num_experts, set(params))
    return expected, trainer.engine.logical_state(), params


def _prove_tensors(report: ValidationReport, ck: Checkpoint, cfg: Config, trainer: Trainer) -> None:
    expected, state, params = _restored(ck, cfg, trainer)
    for name in sorted(state):
        entry = state[name]
        for key, suffix in STATE_SUFFIX.items():
            if key not in entry:  # AdamW params have no momentum buffer, Muon matrices no Adam moments
                continue
            want, got = expected.get(name + suffix), entry.get(key)
            stage = "master" if key == "master" else "moment"
            if want is None:
                report.add(Check(stage, name + suffix, False, "missing from the checkpoint"))
            elif got.dtype != torch.float32:
                report.add(Check(stage, name + suffix, False, f"restored as {got.dtype}, not float32"))
            elif not _equal(got, want):
                diff = (got.cpu() - want).abs().max().item()
                report.add(Check(stage, name + suffix, False, f"differs from the checkpoint (max |diff| {diff:.3e})"))
            else:
                report.add(Check(stage, name + suffix, True))
        p = params[name].detach()
        _prove_saved_weight(report, name, expected.get(name), entry["master"])
        storage = quantized_storage_of(params[name])
        if storage is not None:  # fp8/fp4 param gather: the live weight is the recipe's quantization of it
            ok = storage.matches_master(params[name], entry["master"])
            why = f"quantized param != {storage.recipe.name} quantization of its master"
            report.add(Check("param", name, ok, "" if ok else why))
            continue
        ok = _equal(p, entry["master"].to(p.dtype))  # on the device: no host copies
        report.add(Check("param", name, ok, "" if ok else f"param != master cast to {p.dtype}"))


def _prove_saved_weight(report: ValidationReport, name: str, saved: Optional[torch.Tensor],
                        master: torch.Tensor) -> None:
    """The checkpoint's model weight is its master cast to the weight's dtype. The live param is rebuilt from the
    master, so the "param" row cannot see a model file that disagrees with the masters (a user trial scaled one
    weight in the file and resealed it: valid, and export-hf wrote the scaled weight); an expert the probe
    batch never routes to would not move the probe loss either."""
    if saved is None:
        report.add(Check("weight", name, False, "missing from the checkpoint"))
        return
    ok = _equal(master.to(saved.dtype), saved)  # `to` returns an fp32 master itself: no copy
    report.add(Check("weight", name, ok, "" if ok else f"checkpoint weight != its master cast to {saved.dtype}"))


def _equal(live: torch.Tensor, saved: torch.Tensor) -> bool:
    """`live` (on the run's device) equals `saved` (read on the host) bit for bit as torch.equal tells. Compared
    on the device: one host-to-device copy of the saved tensor instead of a device-to-host copy of the live one
    and a host comparison on the rank's one CPU thread (at the reference size, tens of GB per rank)."""
    return torch.equal(live, saved.to(live.device))


def _prove_weights(report: ValidationReport, ck: Checkpoint, cfg: Config, trainer: Trainer) -> None:
    """Weights-only restore: every master is the checkpoint's weight as fp32, every param the master's cast."""
    why = ("none in the checkpoint: model weights only (import-hf, or saved without optimizer state)"
           if is_model_only(ck) else "not loaded: checkpoint.no_load_optim=true")  # fmt: skip
    report.add(Check("master", "-", True, f"{why}; nothing to compare, masters rebuilt from the weights"))
    expected, state, params = _restored(ck, cfg, trainer)
    for name in sorted(state):
        want, master = expected.get(name), state[name]["master"]
        if want is None:
            report.add(Check("weight", name, False, "missing from the checkpoint"))
            continue
        if not _equal(master, want.float()):
            diff = (master.cpu() - want.float()).abs().max().item()
            report.add(Check("weight", name, False, f"restored master != checkpoint weight (max |diff| {diff:.3e})"))
            continue
        storage = quantized_storage_of(params[name])
        if storage is not None:  # fp8/fp4 param gather: the live weight is the recipe's quantization of it
            ok = storage.matches_master(params[name], state[name]["master"])
            report.add(Check("weight", name, ok, "" if ok else f"param != {storage.recipe.name} quantization"))
            continue
        p = params[name].detach()
        ok = _equal(p, want.float().to(p.dtype))
        report.add(Check("weight", name, ok, "" if ok else f"param != checkpoint weight cast to {p.dtype}"))


def _prove_probe(report: ValidationReport, ck: Checkpoint, cfg: Config, trainer: Trainer) -> None:
    recorded = ck.meta.get("probe", {})
    if "loss" not in recorded:
        hint = " (imported with --no-probe)" if "hf" in ck.meta else ""
        report.add(Check("probe", "-", False, f"the checkpoint records no probe loss{hint}"))
        return
    want = float.fromhex(recorded["loss_hex"]) if "loss_hex" in recorded else float(recorded["loss"])
    got = trainer.probe_loss()
    saved_cfg = ck.meta.get("config", {})
    same = (
        ck.meta.get("expert_layout") == expert_layouts(cfg)[0]
        and ck.meta.get("recipe") == recipe_meta(cfg)
        and ck.meta.get("world", {}).get("dp") == trainer.rt.world_size
        and saved_cfg.get("moe", {}).get("glu_interleave_size") == cfg.moe.glu_interleave_size
    )
    if same:
        ok = got == want
        detail = f"recomputed {got!r}, recorded {want!r} (bitwise: same layout, recipe and world size)"
    else:
        rtol = PROBE_RTOL[torch.bfloat16 if cfg.mixed_precision.bf16 else torch.float32]
        ok = math.isfinite(got) and abs(got - want) <= rtol * abs(want)
        detail = f"recomputed {got!r}, recorded {want!r} (within {rtol:g} relative: other layout or world size)"
    report.add(Check("probe", "-", ok, detail))


def probe_loss_of_weights(cfg: Config, weights: dict[str, torch.Tensor]) -> float:
    """The probe loss `ckpt validate` will recompute for a checkpoint of these weights (logical tensors in
    `cfg`'s layout): `import-hf` writes checkpoints without a training run, so it records this number.

    Built from `cfg` and loaded exactly as a model-only checkpoint loads (`load_model_weights`), so
    validate's recomputation is bitwise the same. Builds a whole trainer (model, optimizer, data) on this
    process: it needs the memory a one-process `ckpt validate` of the checkpoint needs.
    """
    cfg = copy.deepcopy(cfg)
    cfg.checkpoint.load = None
    cfg.checkpoint.save_interval = None
    with tempfile.TemporaryDirectory(prefix="moectl-probe-") as run_dir:
        cfg.run_dir = run_dir  # never written: the trainer is not run
        trainer = Trainer(cfg, SilentObserver())
        load_model_weights(weights, cfg, trainer.model, trainer.engine, trainer.rt.pstate)
        return trainer.probe_loss()
