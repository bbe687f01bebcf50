"""`MicroBatchGraph`: a micro-batch's forward and backward, captured once and replayed (`train.cuda_graph`).

What the graph holds, and what stays outside (Megatron-Core and TE capture the same span per layer; one
graph per micro-batch removes every launch of the step but the optimizer's):

    outside, eagerly, each step     zero the grad buffers; finish the param gather (or stage it for the
                                    first graph, below); refresh the pinned quantized weights
                                    (static_weights.py); copy the batch into the static input tensors
    inside, replayed per micro-batch  forward, loss, backward, the fold of each weight grad into `main_grad`
    inside, the first micro-batch   data parallel with `overlap_param_gather` (high-precision params): the
                                    param all-gathers too, launched by the forward's pre-hooks one group
                                    ahead, and waited
    inside, the last micro-batch    data parallel: the grad reductions too, launched by the backward's hooks
                                    as buckets complete (`overlap_grad_reduce`) or at its end, and waited
    outside, after the last replay  the optimizer step (clip, non-finite guard, update, stage the params)

Nothing inside depends on which step it is (seed 003): `main_grad` is zeroed outside (an expert grad
flagged stale instead, its flag read and cleared by the wgrad kernel inside, `trainer/main_grad.py`) and
every micro-batch adds into it. The middle micro-batches are captured under the engine's `no_sync` with
their params settled, so no hook launches a collective from them. The first is a graph of its own,
captured with every group staged, so its pre-hooks' gathers overlap its forward as they do eagerly; the last
is another, captured under the last micro-batch's hooks and ended by the engine's `finish_grad_sync`, so its
reduce-scatters (or all-reduces) overlap its backward. No Python runs in a replay: the engine stages the
groups before the first one's and marks them gathered after it, and marks them reduced after the last one's.
Without data parallelism, or with `MOECTL_GRAPH_PARAM_GATHER=0` / `MOECTL_GRAPH_GRAD_SYNC=0` (the A/B
switches), the gather finishes before the step and the reductions are launched after the last replay, as
before. Weights are read from pinned tensors refreshed before the step. Python that runs during the forward
(hooks, the MoE layers' statistics) runs once, at capture: the layers' `stats` are pointed back at the
graph's outputs after each replay, so metrics read the replayed values.

Shapes must be static: drop-and-pad experts, or dropless ones, whose T*K rows (plus alignment padding
sized to its static bound under a recipe) are split among experts by device offsets, where the recipe's
grouped GEMMs read them there (MOE034, `static_expert_rows`); one expert-parallel rank, or the all-to-all
under drop-and-pad, whose collectives (static splits, the ep group's own communicator) are captured with the
micro-batch (MOE058, `static_token_exchange`); a backend
that reads no counts on the host (MOE059). The first step runs eagerly (compiles, autotuning, lazily built
state); the next step captures each variant at its first micro-batch of that kind (first, middle, last),
all on one private memory pool.
"""

from __future__ import annotations

import gc
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from moectl.core.config.schema import Config
from moectl.core.errors import MoectlError
from moectl.core.rules import null_graph_policy
from trainer import grad_sq
from trainer.distributed.bucket_group import GradSyncError
from trainer.distributed.param_sync import ParamSyncError
from trainer.graphs.static_weights import StaticWeights
from trainer.moe import wgrad_deferral
from trainer.moe.layer import MoELayer


class GraphCaptureError(MoectlError):
    """The step could not be captured into a CUDA graph (an operation that synchronises with the host)."""


@dataclass
class ReplayedLoss:
    """The loss parts a replay leaves in the graph's static output tensors (valid until the next replay of any
    variant: the variants share one memory pool)."""

    lm_loss: torch.Tensor
    aux_loss: torch.Tensor


@dataclass
class _Captured:
    """One captured variant: the graph and what its replays leave behind."""

    graph: torch.cuda.CUDAGraph
    out: ReplayedLoss
    stats: list[tuple[nn.Module, Any]]
    sq_records: list[grad_sq.SqRecord]  # what its backward recorded at the capture (armed variants)


class MicroBatchGraph:
    """Captures `loss_fn(tokens, targets)` and its backward (`total / n_micro`) once; replays it after.

    A few variants, each captured at its first use, all on one private memory pool (never replayed
    concurrently, always in capture order within a step): the micro-batch alone; the first one of a data
    parallel step, whose forward gathers the params; the last one, followed by `finish()` (its grad
    reductions); both at once when a step has one micro-batch; and, on one data-parallel rank, the last one
    armed to leave the expert grads' sums of squares for the norm (`trainer/grad_sq.py`).
    `model` is searched for MoE layers (their `stats`) and published quantized weights (pinned).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], Any], n_micro: int) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.n_micro = n_micro
        self.weights = StaticWeights(model)
        self.tokens: torch.Tensor | None = None
        self.targets: torch.Tensor | None = None
        # keyed by (gathers, finish(), final_sq, wgrad_defer, the micro-batch under moe.defer_expert_wgrad)
        self._variants: dict[tuple[bool, bool, bool, bool | None, int | None], _Captured] = {}
        self.replays = 0

    @property
    def captured(self) -> bool:
        return bool(self._variants)

    def refresh_weights(self) -> None:
        """Bring the pinned quantized weights up to the published ones (eagerly, before the step's replays)."""
        self.weights.refresh()

    def run(self, tokens: torch.Tensor, targets: torch.Tensor, gathers: bool = False,
            finish: Callable[[], None] | None = None, final_sq: bool = False, wgrad_defer: bool | None = None,
            micro: int = 0) -> ReplayedLoss:
        """Forward + backward of one micro-batch through the graph (captured on the variant's first call).

        `gathers`: the param gathers are staged and pending, so the forward's pre-hooks launch and wait them
        inside the captured span (the step's first micro-batch): a variant of its own. `finish`: run at the
        end of the captured span, so its device work replays with the micro-batch (the engine's
        `finish_grad_sync`: every grad reduction launched and waited inside the graph). Hooks and `finish`
        run in Python at the capture only; the caller records their effect after each replay. `final_sq`: the
        step's last micro-batch, whose backward leaves the grads' sums of squares (`trainer/grad_sq.py`): a
        variant of its own, whose capture's records are recorded again after each replay.
        `wgrad_defer` (`moe.defer_expert_wgrad`, `trainer/moe/wgrad_deferral.py`): True for a micro-batch that keeps
        its expert wgrad operands, False for one that reads them (a flush): each `micro` is then a variant of its
        own, so what one keeps sits at its own addresses until its flush's replay reads them."""
        key = (gathers, finish is not None, final_sq, wgrad_defer, micro if wgrad_defer is not None else None)
        if self.tokens is not None:
            assert self.targets is not None
            if tokens.shape != self.tokens.shape or targets.shape != self.targets.shape:
                raise GraphCaptureError(
                    f"a micro-batch of shape {tuple(tokens.shape)} after capturing {tuple(self.tokens.shape)}",
                    "CUDA graphs replay fixed shapes: keep train.micro_batch_size and model.seq_length fixed",
                )
            self.tokens.copy_(tokens, non_blocking=True)
            self.targets.copy_(targets, non_blocking=True)
        else:
            self.tokens, self.targets = tokens.clone(), targets.clone()
        variant = self._variants.get(key)
        if variant is None:
            variant = self._variants[key] = self._capture(finish, final_sq, wgrad_defer)
        variant.graph.replay()
        self.replays += 1
        grad_sq.restore(variant.sq_records)
        for layer, stats in variant.stats:  # the other variant or an eager forward (eval) pointed them elsewhere
            layer.stats = stats
        return variant.out

    def release_eager_graphs(self) -> None:
        """Drop what still holds an eager step's autograd graph: the MoE layers' `stats` (their aux losses).
        That graph keeps each param's grad accumulator alive, and autograd reuses a live accumulator in the
        next forward with the stream it was made on: the default stream, which a capture must not touch
        ("operation would make the legacy stream depend on a capturing blocking stream")."""
        for m in self.model.modules():
            if isinstance(m, MoELayer):
                m.stats = None
        gc.collect()

    def _capture(self, finish: Callable[[], None] | None, final_sq: bool = False,
                 wgrad_defer: bool | None = None) -> _Captured:
        assert self.tokens is not None and self.targets is not None
        self.release_eager_graphs()
        torch.cuda.synchronize()
        # Blocks the eager steps cached would otherwise sit beside the graph's private pool.
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        # One pool for every variant: a later capture reuses an earlier one's activations, which are dead
        # between replays. A later variant's outputs may sit in blocks an earlier one used as scratch, so an
        # earlier variant's replay overwrites them: the loop reads each replay's losses before the next, the
        # layers' stats are pointed back after every replay, and metrics read the step's last one before the
        # next step's first. The variants are fixed per run and replay in their capture order.
        pool = next(iter(self._variants.values())).graph.pool() if self._variants else None
        try:
            # A compiled region whose guards fail here would compile inside the capture, and inductor's
            # compile copies host tensors to the device, which a capture refuses. Such a region runs its
            # eager code into the graph instead (seen on an H100 when an earlier model of the same process
            # had left Dynamo entries with dynamic shapes whose guard failed at the capture).
            earlier = grad_sq.recorded()
            grad_sq.clear()  # what remains recorded after the capture is what its backward recorded
            with (torch.compiler.set_stance("eager_on_recompile"), torch.cuda.graph(graph, pool=pool),
                  grad_sq.final_accumulation(final_sq), wgrad_deferral.micro_batch_phase(wgrad_defer)):
                parts = self.loss_fn(self.tokens, self.targets)
                (parts.total / self.n_micro).backward()
                if finish is not None:
                    finish()
            records = grad_sq.recorded()
            grad_sq.clear()
            grad_sq.restore(earlier)
            grad_sq.restore(records)
        except (GradSyncError, ParamSyncError):
            raise  # the step's own bookkeeping (a param without a grad under overlap): its message has the fix
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GraphCaptureError(
                f"train.cuda_graph: the micro-batch could not be captured at {_culprit(e)} ({first})",
                "set train.cuda_graph=false, and report the config: something in the step synchronises with the host",
            ) from e
        stats = [(m, m.stats) for m in self.model.modules() if isinstance(m, MoELayer)]
        return _Captured(graph, ReplayedLoss(parts.lm_loss.detach(), parts.aux_loss.detach()), stats, records)


def _culprit(e: BaseException) -> str:
    """The innermost frame of moectl's own code in `e`'s traceback (`path:line`), else "an unknown place"."""
    roots = ("trainer", "ckpt", "moectl")
    place = "an unknown place (inside torch)"
    for frame in traceback.extract_tb(e.__traceback__):
        parts = Path(frame.filename).parts
        for i, part in enumerate(parts):
            if part in roots and i + 1 < len(parts) and "site-packages" not in parts:
                place = f"{'/'.join(parts[i:])}:{frame.lineno}"
                break
    return place


def wants_cuda_graph(cfg: Config, device: torch.device, capability: tuple[int, int] | None = None) -> bool:
    """Whether the run captures graphs: `train.cuda_graph` when set, else (null) on exactly where graphs were
    measured to win and checked bitwise against eager (docs/benchmarks.md, tests/trainer/graphs): a Hopper
    or Blackwell GPU (`capability`, else the device's), bf16 params, static expert rows
    (`static_expert_rows`), one expert-parallel rank or the all-to-all under drop-and-pad
    (`static_token_exchange`: ep=4 on 4 H100s, 374 -> 258 ms), a grouped backend (not loop or te), Adam or Muon, no
    fp8 or fp8 tensorwise (e4m3 or hybrid), no delayed wgrad. Elsewhere `true` still works
    (the rules say what it needs); null does not take the chance: `torch._grouped_mm` keeps its group offsets
    on the device only for bf16 on sm90/sm100, and falls back to a loop that reads them on the host for fp32 params or
    older GPUs. The policy itself is `moectl.core.rules.null_graph_policy`, which MOE064 shares."""
    if cfg.train.cuda_graph is not None:
        return cfg.train.cuda_graph
    if device.type != "cuda":
        return False
    return null_graph_policy(cfg, (capability or torch.cuda.get_device_capability(device))[0])
