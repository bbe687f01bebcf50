"""The training loop: micro-batches to the global batch, step, evaluate, record, stop cleanly.

One step: zero grads -> for each micro-batch: forward, loss / n_micro, backward (the last one lets
the engine launch grad reduction) -> engine.step(lr) -> metrics. A non-finite loss or grad norm stops
the run with a clear message (`train.on_nonfinite: stop`) or skips the update (`skip`).
SIGINT/SIGTERM end the run after the current step, with metrics flushed.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from ckpt import list_committed, resolve_load_path
from moectl.core.config import dump_config
from moectl.core.config.schema import Config
from moectl.core.params import count_params
from moectl.core.errors import MoectlError
from trainer.build import build_data_for, build_engine, build_model
from trainer.checkpointing import load_training_checkpoint, save_training_checkpoint
from trainer.compile import compile_backend, compile_regions, wants_compile
from trainer.data import Sampler
from trainer.flops import flops_per_token, peak_tflops
from trainer.metrics import MetricsWriter, expert_balance
from trainer.observer import PrintObserver, RunObserver, SilentObserver
from trainer.optim.lr_schedule import lr_at
from trainer.precision import describe
from trainer.regions import OPTIMIZER, region
from trainer.runtime import Runtime, setup_runtime


class NonFiniteError(MoectlError):
    """A non-finite loss or grad norm under `train.on_nonfinite: stop`."""


@dataclass
class TrainResult:
    """How a run ended."""

    steps: int
    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    skipped_steps: int = 0
    stopped_by: str | None = None
    run_dir: Path | None = None


class _StopFlag:
    """SIGINT/SIGTERM set a flag; the loop ends after the step in flight (a second Ctrl-C aborts)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. under a test runner): no handler
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    """Runs `cfg` to `train.train_iters` steps on this process's device."""

    def __init__(self, cfg: Config, observer: RunObserver | None = None, runtime: Runtime | None = None) -> None:
        self.cfg = cfg
        self.rt = runtime or setup_runtime(cfg.train, cfg.parallel)
        self.observer: RunObserver = observer or PrintObserver()
        tc = cfg.train
        self.dp = self.rt.world_size
        self.n_micro = tc.global_batch_size // (tc.micro_batch_size * self.dp)
        self.model = build_model(cfg, self.rt.device, self.rt.pstate)
        self.engine = build_engine(cfg, self.model, self.rt)
        # Regional compile after the engine's wrap: its hooks stay on the modules, outside the graphs.
        self.compiled_regions = (
            compile_regions(self.model, deterministic=tc.deterministic) if wants_compile(tc.compile, self.rt.device)
            else []
        )  # fmt: skip
        self.train_data, eval_sampler = build_data_for(cfg, self.rt)
        # The same held-out batches at every evaluation, so eval losses are comparable across steps.
        self.eval_batches = eval_sampler.eval_batches(cfg.train.eval_iters) if cfg.train.eval_interval else []
        # The checkpoint probe: one fixed held-out batch, the same whatever the world size.
        self.probe_batch = Sampler(
            eval_sampler.stream, seq_length=cfg.model.seq_length, micro_batch_size=cfg.train.micro_batch_size,
            global_batch_size=cfg.train.micro_batch_size,
        ).eval_batches(1)[0]
        self.start_step = 0
        self.carried_meta: dict[str, Any] = {}  # meta the loaded checkpoint passes on to this run's saves
        self.weights_only = False  # loaded a checkpoint's model weights without its optimizer state
        self.last_record: dict[str, Any] | None = None  # the latest step's metrics record
        self._refuse_to_overwrite_checkpoints()
        if cfg.checkpoint.load:
            restored = load_training_checkpoint(
                resolve_load_path(cfg.checkpoint.load), cfg, self.model, self.engine, self.rt.pstate
            )
            self.start_step = restored.step
            self.resumed_from = restored.path
            self.carried_meta = restored.carried
            self.weights_only = not restored.optimizer_state
        self.run_dir = Path(cfg.run_dir)
        self.tokens_per_step = tc.global_batch_size * cfg.model.seq_length
        self.flops_per_step = flops_per_token(cfg.model, cfg.moe) * self.tokens_per_step
        self.peak = peak_tflops(self.rt.device, "fp8" if cfg.mixed_precision.fp8 else "bf16")

    # --- one step ---------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, Any]:
        """Run optimizer step `step` (0-based): its micro-batches, backward and update; returns its record
        (`step, loss, aux_loss, grad_norm, lr, skipped, expert_balance`). Host-synchronising only through the
        record's numbers; `run` times it and adds `tokens_per_s` and `mfu`."""
        model, engine = self.model, self.engine
        model.train()
        engine.zero_grad()
        lm_sum = torch.zeros((), device=self.rt.device, dtype=torch.float64)
        aux_sum = torch.zeros((), device=self.rt.device, dtype=torch.float64)
        for micro, (tokens, targets) in enumerate(self._step_batches(step)):
            with engine.micro_batch(is_last=micro == self.n_micro - 1):
                parts = model.loss(tokens, targets)
                (parts.total / self.n_micro).backward()
            lm_sum += parts.lm_loss.detach().double()
            aux_sum += parts.aux_loss.detach().double()
        lm = self._mean_over_dp(lm_sum / self.n_micro)  # the same on every rank: they agree on stopping
        if not math.isfinite(lm) and self.cfg.train.on_nonfinite == "stop":
            raise NonFiniteError(
                f"non-finite loss at step {step + 1} (loss={lm}); no update was applied",
                "lower optimizer.lr or raise optimizer.lr_warmup_iters, or set train.on_nonfinite=skip",
            )
        lr = lr_at(step, self.cfg.optimizer, self.cfg.train.train_iters)
        # A non-finite grad norm is agreed on by all ranks inside the engine: it skips the update
        # everywhere, or (on_nonfinite: stop) raises NonFiniteGradError everywhere.
        with region(OPTIMIZER):
            result = engine.step(lr)
        return {
            "step": step + 1,
            "loss": lm,
            "aux_loss": self._mean_over_dp(aux_sum / self.n_micro),
            "grad_norm": result.grad_norm,
            "lr": lr,
            "skipped": result.skipped or not math.isfinite(lm),
            "expert_balance": expert_balance(self._tokens_per_expert()),
        }

    def _step_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of `step`, on the device, all copied at the start of the step.

        On CUDA the copy comes from pinned memory without blocking the host: a copy from pageable memory
        waits for the GPU to drain the stream, so loading each micro-batch just before its forward left the
        GPU idle at every micro-batch boundary while the host launched the next forward's first kernels.
        """
        batches = [self.train_data.micro_batch(step, m) for m in range(self.n_micro)]
        device = self.rt.device
        if device.type != "cuda":
            return [(t.to(device), y.to(device)) for t, y in batches]
        both = torch.stack([torch.stack(b) for b in batches]).pin_memory().to(device, non_blocking=True)
        return [(both[m, 0], both[m, 1]) for m in range(self.n_micro)]

    def _tokens_per_expert(self) -> list[list[int]]:
        """Every MoE layer's routings per expert of the last micro-batch, read with one device sync."""
        counts = [m.tokens_per_expert for m in self.model.moe_layers() if m.tokens_per_expert is not None]
        return torch.stack(counts).tolist() if counts else []

    def _mean_over_dp(self, value: torch.Tensor) -> float:
        if self.dp > 1:
            value = value.clone()
            torch.distributed.all_reduce(value)
            value /= self.dp
        return float(value)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean LM loss over `train.eval_iters` fixed held-out micro-batches (same batches every time)."""
        self.engine.sync_params_for_eval()
        self.model.eval()
        total = torch.zeros((), device=self.rt.device, dtype=torch.float64)
        for tokens, targets in self.eval_batches:
            total += self.model.loss(tokens.to(self.rt.device), targets.to(self.rt.device)).lm_loss.double()
        self.model.train()
        return self._mean_over_dp(total / len(self.eval_batches))

    def _refuse_to_overwrite_checkpoints(self) -> None:
        """A fresh run that would save into a folder holding another run's checkpoints stops now, before
        training (a save onto an existing step is refused, and the old run's `latest` must stay good)."""
        ccfg = self.cfg.checkpoint
        if not ccfg.save_interval or ccfg.load:
            return
        root = Path(self.cfg.run_dir) / "checkpoints"
        if root.is_dir() and list_committed(root):
            raise MoectlError(
                f"{root} already holds checkpoints of an earlier run, and checkpoint.load is not set",
                f"resume it with --set checkpoint.load={root}, or train into another --run-dir",
            )

    @torch.no_grad()
    def probe_loss(self) -> float:
        """LM loss of the fixed probe batch (recorded in each checkpoint; `ckpt validate` recomputes it)."""
        self.engine.sync_params_for_eval()
        self.model.eval()
        tokens, targets = self.probe_batch
        loss = float(self.model.loss(tokens.to(self.rt.device), targets.to(self.rt.device)).lm_loss)
        self.model.train()
        return loss

    def save(self, step: int) -> Path:
        """Commit a checkpoint of the state after `step` steps (collective: every rank calls it)."""
        return save_training_checkpoint(self.run_dir / "checkpoints", step, self.cfg, self.engine, self.rt.pstate,
                                        self.probe_loss(), carried=self.carried_meta)

    # --- the run ----------------------------------------------------------------------------
    def _banner(self) -> list[str]:
        cfg = self.cfg
        params = count_params(cfg.model, cfg.moe)
        total, active = params.total, params.active
        lines = [
            f"moectl train {cfg.model.num_layers} layers, d={cfg.model.hidden_size}, "
            f"{cfg.moe.num_experts} experts top-{cfg.moe.router_topk}: {total / 1e6:.2f}M params "
            f"({active / 1e6:.2f}M active/token) on {self.rt.device} x{self.rt.world_size}",
            f"  data: {self.train_data.stream.describe()} | batch {cfg.train.global_batch_size} x {cfg.model.seq_length} "
            f"tokens ({self.n_micro} micro-batches of {cfg.train.micro_batch_size}/rank) | run_dir {self.run_dir}",
        ]
        if self.compiled_regions:
            lines.append(
                f"  compile: regional, {len(self.compiled_regions)} regions (norms, attention core, routers) "
                f"through {compile_backend()}; the first step compiles them"
            )
        # Say which GEMMs run native and which are emulated: a run never pretends.
        lines.append("  " + describe(self.model.recipe, self.rt.device))  # begins "precision: ..."
        if cfg.train.cuda_graph:  # validated (MOE034, MOE035) but not captured: the run says so (MOE050)
            lines.append("  cuda_graph: not captured in this build (MOE050): every micro-batch runs eagerly")
        mp = cfg.mixed_precision
        if mp.fp8_param_gather or mp.fp4_param_gather:
            staged = "bf16 staged on the grad buffer" if mp.reuse_grad_buf_for_mxfp8_param_ag or mp.fp4 else "bytes"
            lines.append(
                f"  param gather: block weights stored {mp.fp4_recipe if mp.fp4 else mp.fp8_recipe}, all-gathered "
                f"as {staged}; fp32 masters from the init values"
            )
        return lines

    def run(self) -> TrainResult:
        """Train to `train.train_iters`; returns the per-step losses and how the run ended."""
        cfg, tc, main = self.cfg, self.cfg.train, self.rt.is_main
        result = TrainResult(steps=self.start_step, run_dir=self.run_dir)
        observer = self.observer if main else SilentObserver()
        if main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump_config(cfg))
            observer.started(self._banner())
        start = self.start_step
        writer = (
            MetricsWriter(self.run_dir, jsonl=cfg.logging.jsonl, tensorboard=cfg.logging.tensorboard, resume=start > 0)
            if main
            else None
        )
        if start:
            observer.log(f"  resumed from {self.resumed_from} at step {start}")
        if self.weights_only:
            observer.log(f"  loaded model weights only from {self.resumed_from}: fresh optimizer state")
        save_every = cfg.checkpoint.save_interval
        try:
            with _StopFlag() as stop, observer.running(tc.train_iters, start):
                for step in range(start, tc.train_iters):
                    t0 = time.perf_counter()
                    record = self.train_step(step)
                    if self.rt.device.type == "cuda":
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    record["tokens_per_s"] = self.tokens_per_step / dt
                    if self.peak is not None:
                        record["mfu"] = self.flops_per_step / dt / (self.peak * 1e12 * self.rt.world_size)
                    result.steps = step + 1
                    result.losses.append(record["loss"])
                    self.last_record = record
                    result.skipped_steps += int(record["skipped"])
                    if writer is not None and (step + 1) % tc.log_interval == 0:
                        writer.write(record)
                    observer.step(step + 1, record)
                    if record["skipped"]:
                        observer.log(f"step {step + 1}: non-finite loss or grad norm, update skipped")
                    last = step + 1 == tc.train_iters
                    if tc.eval_interval and ((step + 1) % tc.eval_interval == 0 or last):
                        eval_loss = self.evaluate()
                        result.eval_losses.append((step + 1, eval_loss))
                        if writer is not None:
                            writer.write({"step": step + 1, "eval_loss": eval_loss})
                        observer.evaluated(step + 1, eval_loss)
                    # Save on schedule, at the end, and when asked to stop (SIGTERM from a scheduler).
                    if save_every and ((step + 1) % save_every == 0 or last or stop.signal is not None):
                        path = self.save(step + 1)
                        observer.log(f"saved {path}")
                    if stop.signal is not None:
                        result.stopped_by = stop.signal
                        observer.log(f"{stop.signal}: stopped cleanly after step {step + 1}")
                        break
        finally:
            if writer is not None:
                writer.close()
        return result


def train(cfg: Config, observer: RunObserver | None = None) -> TrainResult:
    """Run `cfg` on this process (rank and world from torchrun's environment when launched by it)."""
    return Trainer(cfg, observer).run()
