"""The training loop: micro-batches to the global batch, step, evaluate, record, stop cleanly.

One step: zero grads -> for each micro-batch: forward, loss / n_micro, backward (the last one lets
the engine launch grad reduction) -> engine.step(lr, loss) -> metrics. With `train.cuda_graph` every step after
the first replays each micro-batch from a captured graph; under data parallelism the first one's holds the
param gathers and the last one's the grad reductions (trainer/graphs/capture.py says what stays out).
A non-finite loss or grad norm stops the run with a clear message (`train.on_nonfinite: stop`) or skips
the update (`skip`); the loss reaches the engine as a device tensor and is read after the update is queued.
SIGINT/SIGTERM/SIGHUP end the run after the step in flight, agreed over all ranks (trainer/stop.py), with a
checkpoint when `checkpoint.save_interval` is set and a warning when it is not. A collective that loses
its peer or times out becomes a one-line error naming the rank and the step (trainer/parallel/failures.py).
`train()` owns the process group it creates and always destroys it.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from ckpt import list_committed, resolve_load_path
from moectl.core.config.schema import Config
from moectl.core.errors import ConfigError, MoectlError, UsageError
from moectl.core.overlap import describe_overlap
from moectl.core.params import count_params
from trainer import grad_sq
from trainer.build import build_data_for, build_engine, build_model
from trainer.checkpointing import load_training_checkpoint, save_training_checkpoint
from trainer.checkpointing.saver import RunCheckpointer, SaveReport
from trainer.compile import compile_backend, compile_regions, wants_compile
from trainer.data import Sampler
from trainer.flops import flops_per_token, peak_tflops
from trainer.graphs import MicroBatchGraph, wants_cuda_graph
from trainer.init_weights import skipped_init
from trainer.metrics import MetricsWriter, expert_balance
from trainer.moe import wgrad_deferral
from trainer.observer import PrintObserver, RunObserver, SilentObserver
from trainer.optim.lr_schedule import lr_at
from trainer.optim.step_result import NonFiniteGradError
from trainer.parallel.failures import collective_failure, raise_if_any_rank_failed
from trainer.parallel.groups import collective_timeout_s, destroy_distributed
from trainer.precision import describe
from trainer.regions import OPTIMIZER, region
from trainer.run_dir import CONFIG, RunDirLock, prepare_run_dir, resolved_config_text
from trainer.run_state import RunState
from trainer.runtime import Runtime, setup_runtime
from trainer.step_weights import StepWeights
from trainer.stop import StopSignals
from trainer.switches import switched_off
from trainer.threads import ThreadChoice, apply_cpu_threads, choose_cpu_threads


class NonFiniteError(MoectlError):
    """A non-finite loss or grad norm under `train.on_nonfinite: stop`."""


@dataclass
class TrainResult:
    """How a run ended. `stopped_by`: the signal that ended it before `train.train_iters` (None when it
    finished); `saved`: the checkpoint it committed last (None when it saved none)."""

    steps: int
    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    skipped_steps: int = 0
    stopped_by: str | None = None
    stop_signum: int | None = None
    saved: Path | None = None
    run_dir: Path | None = None


class Trainer:
    """Runs `cfg` to `train.train_iters` steps on this process's device."""

    def __init__(self, cfg: Config, observer: RunObserver | None = None, runtime: Runtime | None = None, *,
                 verify_checkpoint: bool = True, before_load: Callable[["Trainer"], None] | None = None) -> None:
        """`verify_checkpoint=False`: load `checkpoint.load` without hashing its files first (see
        `load_training_checkpoint`); for `ckpt validate`, which hashes them alongside. `before_load` runs on
        the built trainer just before `checkpoint.load` is read (validate compiles the probe's regions there,
        while its files are hashed on another thread)."""
        self.cfg = cfg
        self.rt = runtime or setup_runtime(cfg.train, cfg.parallel)
        self.observer: RunObserver = observer or PrintObserver()
        self.threads: ThreadChoice | None = None
        if self.rt.device.type == "cpu":
            self.threads = choose_cpu_threads(cfg.train.cpu_threads)
            apply_cpu_threads(self.threads)
        tc = cfg.train
        self.dp = self.rt.world_size
        self.n_micro = tc.global_batch_size // (tc.micro_batch_size * self.dp)
        if tc.cuda_graph and self.rt.device.type != "cuda":  # MOE035, for runs started without the CLI
            raise ConfigError("train.cuda_graph", True, f"CUDA graphs need a CUDA device, not {self.rt.device}",
                              fix="set train.cuda_graph=false, or run on a GPU")  # fmt: skip
        # A checkpoint to load replaces every weight: leave the random draws out (trainer/init_weights.py).
        with skipped_init() if cfg.checkpoint.load else contextlib.nullcontext():
            self.model = build_model(cfg, self.rt.device, self.rt.pstate)
        self.engine = build_engine(cfg, self.model, self.rt)
        # Regional compile after the engine's wrap: its hooks stay on the modules, outside the graphs.
        self.compiled_regions = (
            compile_regions(self.model, deterministic=tc.deterministic) if wants_compile(tc.compile, self.rt.device)
            else []
        )  # fmt: skip
        # train.cuda_graph: each micro-batch's forward + backward replayed from one CUDA graph (trainer/graphs)
        self.graph = (
            MicroBatchGraph(self.model, self.model.loss, self.n_micro) if wants_cuda_graph(cfg, self.rt.device)
            else None
        )  # fmt: skip
        # Recipe weights quantized once per step (trainer/step_weights.py); fp8 param gather publishes its own.
        # With data parallelism and no graph the param gather overlaps the first forward; finishing it before
        # the step would give that overlap up, so each forward quantizes as before there.
        step_weights = StepWeights(self.model)
        self.step_weights = (
            step_weights if step_weights.sites and not cfg.mixed_precision.fp8_param_gather
            and (self.graph or self.dp == 1) else None
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
        self.resumed_from: Path | None = None
        self.last_record: dict[str, Any] | None = None  # the latest step's metrics record
        self._ahead: tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None  # prefetched micro-batches
        self._staging: torch.Tensor | None = None  # pinned host tensor the batches are copied to the device from
        self._staged: torch.cuda.Event | None = None  # the last copy out of `_staging`
        self._refuse_to_overwrite_checkpoints()
        if cfg.checkpoint.load:
            if before_load is not None:
                before_load(self)
            restored = load_training_checkpoint(
                resolve_load_path(cfg.checkpoint.load), cfg, self.model, self.engine, self.rt.pstate,
                verify=verify_checkpoint,
            )
            self.start_step = restored.step
            self.resumed_from = restored.path
            self.carried_meta = restored.carried
            self.weights_only = not restored.optimizer_state
        self.run_dir = Path(cfg.run_dir)
        self.checkpointer = RunCheckpointer(cfg, self.engine, self.rt.pstate, self.run_dir / "checkpoints",
                                            carried=self.carried_meta)  # fmt: skip
        self.tokens_per_step = tc.global_batch_size * cfg.model.seq_length
        self.flops_per_step = flops_per_token(cfg.model, cfg.moe) * self.tokens_per_step
        self.peak = peak_tflops(self.rt.device, "fp8" if cfg.mixed_precision.fp8 else "bf16")

    @property
    def gathers_in_graph(self) -> bool:
        """Whether the first micro-batch's CUDA graph holds the param gathers: the engine can (overlapped,
        high-precision params) and no recipe quantizes the weights once per step, which reads them gathered
        right after the update (`_publish_step_weights`)."""
        return self.graph is not None and self.engine.gathers_in_graph and self.step_weights is None

    # --- one step ---------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, Any]:
        """Run optimizer step `step` (0-based): its micro-batches, backward and update; returns its record
        (`step, loss, aux_loss, grad_norm, lr, skipped, expert_balance`). Host-synchronising only through the
        record's numbers; `run` times it and adds `tokens_per_s` and `mfu`."""
        model, engine = self.model, self.engine
        model.train()
        engine.zero_grad()  # forgets the sums of squares of the grads it zeroes too (grad_sq.py)
        # The last micro-batch's backward leaves the expert grads' sums of squares for the norm (grad_sq.py).
        final_sq = engine.grads_final_after_backward and not switched_off("MOECTL_GRAD_SQ")
        # Micro-batches keep their expert wgrad operands for every fourth and the last (moe/wgrad_deferral.py).
        defers = self.cfg.moe.defer_expert_wgrad and self.n_micro > 1
        lm_sum = torch.zeros((), device=self.rt.device, dtype=torch.float64)
        aux_sum = torch.zeros((), device=self.rt.device, dtype=torch.float64)
        # The first step of a process runs eagerly (compiles, autotuning, lazily built state); graphs after it.
        graph = self.graph if self.graph is not None and step > self.start_step else None
        # Data parallel graphs: the first micro-batch's graph holds the param gathers (its forward's pre-hooks
        # launch them, one group ahead), the last one's the grad reductions (its hooks launch them as buckets
        # complete, its end waits); the others run under no_sync with the params settled.
        gather_in_graph = graph is not None and self.gathers_in_graph
        reduce_in_graph = graph is not None and engine.reduces_in_graph
        if graph is not None and not gather_in_graph:
            engine.sync_params_for_eval()  # the gather completes before the step's replays
        if self.step_weights is not None and not self.step_weights.published:  # the first step, or after a failure
            self._publish_step_weights()
        try:
            if graph is not None:
                graph.refresh_weights()
            for micro, (tokens, targets) in enumerate(self._step_batches(step)):
                last = micro == self.n_micro - 1
                defer = wgrad_deferral.defers(micro, self.n_micro) if defers else None
                if graph is not None:
                    gathers = gather_in_graph and micro == 0
                    reduces = reduce_in_graph and last
                    if gathers:
                        engine.stage_for_graph_gather()
                    with engine.micro_batch(is_last=reduces):
                        parts = graph.run(tokens, targets, gathers=gathers,
                                          finish=engine.finish_grad_sync if reduces else None,
                                          final_sq=final_sq and last, wgrad_defer=defer, micro=micro)
                    if gathers:
                        engine.params_gathered_by_replay()
                    if reduces:
                        engine.grads_reduced_by_replay()
                else:
                    with (engine.micro_batch(is_last=last), grad_sq.final_accumulation(final_sq and last),
                          wgrad_deferral.micro_batch_phase(defer)):
                        parts = model.loss(tokens, targets)
                        (parts.total / self.n_micro).backward()
                lm_sum += parts.lm_loss.detach().double()
                aux_sum += parts.aux_loss.detach().double()
            if defers:
                wgrad_deferral.check_flushed()
        finally:  # the update below changes the weights: nothing may read these copies after it
            if self.step_weights is not None:
                self.step_weights.retract()
        if graph is not None and not reduce_in_graph:
            engine.start_grad_sync()
        lr = lr_at(step, self.cfg.optimizer, self.cfg.train.train_iters)
        # A non-finite grad norm or loss (on any rank) is agreed on by all ranks inside the engine: it skips the
        # update everywhere, or (on_nonfinite: stop) raises NonFiniteGradError everywhere. The loss goes in as a
        # device tensor, so the host queues the update before it reads the loss: reading it first waited for the
        # backward to drain and left the GPU idle while the host then launched the optimizer's kernels.
        grad_error: NonFiniteGradError | None = None
        try:
            with region(OPTIMIZER):
                result = engine.step(lr, loss=lm_sum)
        except NonFiniteGradError as e:  # raised for a non-finite loss too: named as such below
            grad_error = e
        if grad_error is None:
            self._prefetch(step + 1)  # before the reads below wait for the update
            if self.step_weights is not None:  # likewise: the next step's weights, queued behind the update
                self._publish_step_weights()
        lm = self._mean_over_dp(lm_sum / self.n_micro)  # the same on every rank: they agree on stopping
        if not math.isfinite(lm) and self.cfg.train.on_nonfinite == "stop":
            raise NonFiniteError(
                f"non-finite loss at step {step + 1} (loss={lm}); no update was applied",
                "lower optimizer.lr or raise optimizer.lr_warmup_iters, or set train.on_nonfinite=skip",
            )
        if grad_error is not None:
            raise grad_error
        return {
            "step": step + 1,
            "loss": lm,
            "aux_loss": self._mean_over_dp(aux_sum / self.n_micro),
            "grad_norm": result.grad_norm,
            "lr": lr,
            "skipped": result.skipped or not math.isfinite(lm),
            "expert_balance": expert_balance(self._tokens_per_expert()),
        }

    def _publish_step_weights(self) -> None:
        """Quantize the recipe weights for the next forwards (trainer/step_weights.py), from current params: the
        update's param gather is finished first. Valid until `retract`, before the next update."""
        assert self.step_weights is not None
        self.engine.sync_params_for_eval()
        self.step_weights.publish()

    def _step_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of `step`, on the device: the ones `_prefetch` queued during the last
        step's optimizer update, else read and copied now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            return ahead[1]
        return self._load_batches(step)

    def _prefetch(self, step: int) -> None:
        """Read and queue the copy of `step`'s micro-batches now, while the device runs this step's update:
        the host work of reading, stacking and staging a batch otherwise ran while the device sat idle at
        the start of every step (2.6-6.8 ms of a 251 ms step on an H100, profiled). Batches are a pure
        function of the step index, so a prefetch that is never used (the run stops) changes nothing."""
        if self.rt.device.type == "cuda" and step < self.cfg.train.train_iters:
            self._ahead = (step, self._load_batches(step))

    def _load_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`step`'s micro-batches copied to the device in one copy.

        On CUDA the copy comes from pinned memory without blocking the host: a copy from pageable memory
        waits for the GPU to drain the stream, so loading each micro-batch just before its forward left the
        GPU idle at every micro-batch boundary while the host launched the next forward's first kernels. The
        pinned staging tensor is allocated once and reused: its previous copy is waited for first (long done).
        """
        batches = [self.train_data.micro_batch(step, m) for m in range(self.n_micro)]
        device = self.rt.device
        if device.type != "cuda":
            return [(t.to(device), y.to(device)) for t, y in batches]
        both = torch.stack([torch.stack(b) for b in batches])
        if self._staging is None or self._staging.shape != both.shape or self._staging.dtype != both.dtype:
            self._staging = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            self._staged = None
        if self._staged is not None:
            self._staged.synchronize()
        self._staging.copy_(both)
        on_device = self._staging.to(device, non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        return [(on_device[m, 0], on_device[m, 1]) for m in range(self.n_micro)]

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
            raise UsageError(
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
        """Commit a checkpoint of the state after `step` steps, synchronously (collective: every rank calls it).
        A background save of the run still in flight is waited for first. `run` saves through
        `self.checkpointer` instead (in the background where it works)."""
        self.checkpointer.finish()
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
        reuse = self.train_data.reuse_warning(cfg.train.train_iters)
        if reuse is not None:
            lines.append(f"  {reuse}")
        if self.dp > 1:
            lines.append(f"  overlap: {describe_overlap(cfg.parallel, self.dp)}")
        if self.compiled_regions:
            lines.append(
                f"  compile: regional, {len(self.compiled_regions)} regions (norms, attention core, routers) "
                f"through {compile_backend()}; the first step compiles them"
            )
        # Say which GEMMs run native and which are emulated: a run never pretends.
        lines.append("  " + describe(self.model.recipe, self.rt.device))  # begins "precision: ..."
        if cfg.moe.backend == "te":  # the expert GEMMs are TE's, not the recipe's kernels above
            from trainer.moe.backends.te_runtime import describe as describe_te

            recipe = self.model.recipe
            lines.append("  " + describe_te(recipe.name if recipe is not None else None, cfg.moe.activation))
        if self.graph is not None:
            gathers = "the first one's with its param gathers" if self.gathers_in_graph else "param gather before them"
            reduces = ("the last one's with its grad reductions" if self.engine.reduces_in_graph
                       else "grad reduction after")  # fmt: skip
            lines.append(
                f"  cuda_graph{'' if cfg.train.cuda_graph else ' (null: on for this config)'}: the first step eager, "
                f"then each micro-batch's forward + backward replayed from a CUDA graph ({gathers}, {reduces}; "
                "optimizer eager)"
            )
        mp = cfg.mixed_precision
        if mp.fp8_param_gather or mp.fp4_param_gather:
            staged = "bf16 staged on the grad buffer" if mp.reuse_grad_buf_for_mxfp8_param_ag or mp.fp4 else "bytes"
            lines.append(
                f"  param gather: block weights stored {mp.fp4_recipe if mp.fp4 else mp.fp8_recipe}, all-gathered "
                f"as {staged}; fp32 masters from the init values"
            )
        host = []
        if self.threads is not None:
            host.append(f"cpu threads {self.threads.threads}/rank ({self.threads.why})")
        if self.rt.world_size > 1:
            host.append(f"collective timeout {cfg.parallel.distributed_timeout_minutes:g} min "
                        "(parallel.distributed_timeout_minutes)")
        if host:
            lines.append("  host: " + " | ".join(host))
        if cfg.checkpoint.save_interval:
            lines.append("  " + self.checkpointer.describe())
        return lines

    def _open_run_dir(self, overwrite: bool) -> tuple[RunDirLock | None, MetricsWriter | None, list[str]]:
        """Rank 0 prepares run_dir (trainer/run_dir.py), opens the metrics and writes config.yaml; every rank
        then learns whether that worked, so none is left waiting in a collective for a rank that failed."""
        lock, writer, lines, error = None, None, [], None
        if self.rt.is_main:
            cfg, start = self.cfg, self.start_step
            try:
                saves = bool(cfg.checkpoint.save_interval) and start < cfg.train.train_iters  # steps left to save
                # a loaded checkpoint, step 0 included (ckpt import-hf writes one), whose run will save
                saves_after = self.resumed_from is not None and saves
                lock, lines = prepare_run_dir(self.run_dir, resuming=start > 0, overwrite=overwrite,
                                              resumed_at=start if saves_after else None, saves=saves)  # fmt: skip
                writer = MetricsWriter(self.run_dir, jsonl=cfg.logging.jsonl, tensorboard=cfg.logging.tensorboard,
                                       resume_at=start)  # fmt: skip
                if writer.dropped:
                    lines.append(f"metrics.jsonl: dropped {writer.dropped} record(s) after step {start}, written "
                                 "after that checkpoint by an earlier run")  # fmt: skip
                # a resume with nothing to train leaves an existing record be (a new run_dir still gets one)
                if not 0 < cfg.train.train_iters <= start or not (self.run_dir / CONFIG).exists():
                    _write_config(self.run_dir / CONFIG, resolved_config_text(cfg))
            except MoectlError as e:
                error = e
        try:
            raise_if_any_rank_failed(error, self._world_group(), self.rt.world_size)
        except BaseException:
            if writer is not None:
                writer.close()
            if lock is not None:
                lock.release()
            raise
        return lock, writer, lines

    def _world_group(self) -> Any:
        return self.rt.pstate.dp.pg if self.rt.world_size > 1 else None

    def run(self, stop: StopSignals | None = None, overwrite: bool = False, state: RunState | None = None) -> TrainResult:
        """Train to `train.train_iters`; returns the per-step losses and how the run ended.

        `stop`: the signal recorder to honour (the CLI passes one it entered before building the model, so a
        signal during start-up counts); default: one entered here. `overwrite`: a fresh run may replace
        another run's metrics in run_dir. `state` is kept up to date for the caller's error report.
        """
        cfg, tc, main = self.cfg, self.cfg.train, self.rt.is_main
        state = state if state is not None else RunState()
        state.run_dir, state.checkpoint = self.run_dir, self.resumed_from
        result = TrainResult(steps=self.start_step, run_dir=self.run_dir)
        observer = self.observer if main else SilentObserver()
        start = self.start_step
        try:
            lock, writer, notes = self._open_run_dir(overwrite)
        except Exception as e:
            failure = self._as_failure(e, None)
            if failure is None:
                raise
            raise failure from e
        try:
            with stop if stop is not None else StopSignals() as signals:
                observer.started(self._banner())
                for line in notes:
                    observer.log(line)
                if start:
                    observer.log(f"  resumed from {self.resumed_from} at step {start}")
                if start >= tc.train_iters:
                    observer.log(f"  warning: train.train_iters={tc.train_iters} is not past the checkpoint's step "
                                 f"{start}: nothing to train (raise train.train_iters to go on)")  # fmt: skip
                if self.weights_only:
                    observer.log(f"  loaded model weights only from {self.resumed_from}: fresh optimizer state")
                self._reserve_save_buffers(observer, writer)
                with observer.running(tc.train_iters, start):
                    self._loop(signals, observer, writer, result, state)
                # The model holds the last update's params when run() returns (an overlapped gather is
                # otherwise left to a next forward that never comes); every rank got here together.
                self.engine.sync_params_for_eval()
        except KeyboardInterrupt:
            # A second Ctrl-C: out now, without waiting for a save in flight; the process ends before it commits,
            # as a kill would end it (an uncommitted `.tmp-` folder, removed by the next run). A background save
            # that has committed meanwhile is the last good checkpoint.
            committed = self.checkpointer.committed()
            if committed is not None:
                state.checkpoint = committed
            raise
        except Exception as e:
            # The run waits for a save in flight before it ends: it may still commit, and the error then
            # names it as the checkpoint to resume from.
            self.checkpointer.abandon()
            if self.checkpointer.last_committed is not None:
                state.checkpoint = self.checkpointer.last_committed
            failure = self._as_failure(e, state.step)
            if failure is None:
                raise
            raise failure from e
        finally:
            self.checkpointer.close()
            if writer is not None:
                writer.close()
            if lock is not None:
                lock.release()
        return result

    def _reserve_save_buffers(self, observer: RunObserver, writer: MetricsWriter | None) -> None:
        """A run that will save in the background takes its host buffers now, not at its first save: the
        cost moves to start-up (one log line and record). Nothing when no save will happen."""
        save_every = self.cfg.checkpoint.save_interval
        if not save_every or self.start_step >= self.cfg.train.train_iters:
            return
        reserved = self.checkpointer.reserve(self.start_step)
        if reserved is None:
            return
        observer.log(reserved.line())
        if writer is not None:
            writer.write(reserved.record())

    def _as_failure(self, e: Exception, step: int | None) -> MoectlError | None:
        """A backend's lost-peer or timeout error as a one-line `CollectiveFailure`; None for anything else."""
        return collective_failure(e, self.rt.rank, step, collective_timeout_s(self.cfg.parallel))

    def _loop(self, stop: StopSignals, observer: RunObserver, writer: MetricsWriter | None, result: TrainResult,
              state: RunState) -> None:
        cfg, tc = self.cfg, self.cfg.train
        save_every = cfg.checkpoint.save_interval
        saved_step = None
        for step in range(self.start_step, tc.train_iters):
            state.step = step + 1
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
            last = step + 1 == tc.train_iters
            # the last step's record is written whatever the interval: the run's final numbers are in the file
            logged = writer is not None and ((step + 1) % tc.log_interval == 0 or last)
            if logged:
                writer.write(record)
            observer.step(step + 1, record)
            if record["skipped"]:
                observer.log(f"step {step + 1}: non-finite loss or grad norm, update skipped")
            # Every rank asks every step, so a signal that reached one rank stops all after the same step;
            # a failed background save rides on the same all-reduce and stops all after the same step too.
            agreed = stop.agree(self._world_group(), self.rt.world_size, save_failed=self.checkpointer.failed())
            if agreed.save_failed:
                self.checkpointer.finish()  # raises that save's error, the same on every rank
            self._saved(self.checkpointer.poll(), observer, writer, result, state)
            stopping = agreed.stop and not last
            if stopping:  # said now: a save (and an eval) can take long after the signal
                observer.log(f"{stop.signal}: stopping after step {step + 1}"
                             + ("; saving a checkpoint first" if save_every else "")
                             + ("; Ctrl-C again aborts without saving" if save_every and stop.signal == "SIGINT"
                                else ""))  # fmt: skip
            if stopping and writer is not None and not logged:  # so is the step a signal stopped the run at
                writer.write(record)
            if tc.eval_interval and ((step + 1) % tc.eval_interval == 0 or last):
                eval_loss = self.evaluate()
                result.eval_losses.append((step + 1, eval_loss))
                if writer is not None:
                    writer.write({"step": step + 1, "eval_loss": eval_loss})
                observer.evaluated(step + 1, eval_loss)
            # Save on schedule, at the end, and when asked to stop (SIGTERM from a scheduler).
            if save_every and ((step + 1) % save_every == 0 or last or stopping):
                for report in self.checkpointer.save(step + 1, self.probe_loss):
                    self._saved(report, observer, writer, result, state)
                saved_step = step + 1
            if stopping:
                result.stopped_by, result.stop_signum = stop.signal, stop.signum
                break
        # The run ends only once its last save has committed (SIGTERM included): `latest` then names it.
        self._saved(self.checkpointer.finish(), observer, writer, result, state)
        if result.stopped_by:
            if saved_step == result.steps and result.saved is not None:
                observer.log(f"{stop.signal}: stopped cleanly after step {result.steps}; resume with "
                             f"--set checkpoint.load={result.saved.parent}")  # fmt: skip
            else:
                observer.log(f"warning: {stop.signal}: stopped after step {result.steps} with nothing saved "
                             "(checkpoint.save_interval is not set): these steps cannot be resumed")  # fmt: skip

    def _saved(self, report: SaveReport | None, observer: RunObserver, writer: MetricsWriter | None,
               result: TrainResult, state: RunState) -> None:
        """A committed save: the log line, its `metrics.jsonl` record, and the run's newest checkpoint."""
        if report is None:
            return
        result.saved = state.checkpoint = report.path
        state.saved_by_this_run = True
        observer.log(report.line())
        if writer is not None:
            writer.write(report.record())


def _write_config(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise MoectlError(f"{path}: cannot write the resolved config ({e.strerror or e})",
                          "make run_dir writable, or train into another --run-dir") from None  # fmt: skip


def train(cfg: Config, observer: RunObserver | None = None, *, stop: StopSignals | None = None,
          overwrite: bool = False, state: RunState | None = None) -> TrainResult:
    """Run `cfg` on this process (rank and world from torchrun's environment when launched by it).

    The process groups this creates are destroyed when the run ends, however it ends. A process that
    joined a gloo group should then end without the interpreter's finalization (the CLI does: see
    moectl/cli/exit_codes.py for why). `state` tells the caller where a failed run was
    (trainer/run_state.py).
    """
    state = state if state is not None else RunState()
    try:
        try:
            trainer = Trainer(cfg, observer)
        except Exception as e:  # a peer lost while the groups, model or data were being set up
            rank = int(os.environ.get("RANK", "0"))
            failure = collective_failure(e, rank, None, collective_timeout_s(cfg.parallel))
            if failure is not None:
                raise failure from e
            raise
        return trainer.run(stop=stop, overwrite=overwrite, state=state)
    finally:
        destroy_distributed()
