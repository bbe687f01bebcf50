"""`MicroBatchGraph`: a micro-batch's forward and backward, captured once and replayed (`train.cuda_graph`).

What the graph holds, and what stays outside (Megatron-Core and TE capture the same span per layer; one
graph per micro-batch removes every launch of the step but the optimizer's):

    outside, eagerly, each step     zero the grad buffers; finish the param gather; refresh the pinned
                                    quantized weights (static_weights.py); copy the batch into the static
                                    input tensors
    inside, replayed per micro-batch  forward, loss, backward, the fold of each weight grad into `main_grad`
    outside, after the last replay  launch the grad reduction, then the optimizer step (clip, non-finite
                                    guard, update, param gather)

Nothing inside depends on which micro-batch it is (seed 003): `main_grad` is zeroed outside (an expert
grad flagged stale instead, its flag read and cleared by the wgrad kernel inside, `trainer/main_grad.py`)
and every micro-batch adds into it; the capture always runs under the engine's `no_sync`, so no bucket launches a
collective from inside the graph, and the loop launches them all after the last replay; weights are read
from pinned tensors refreshed before the step. Python that runs during the forward (hooks, the MoE
layers' statistics) runs once, at capture: the layers' `stats` are pointed back at the graph's outputs
after each replay, so metrics read the replayed values.

Shapes must be static: drop-and-pad experts, or dropless ones, whose T*K rows (plus alignment padding
sized to its static bound under a recipe) are split among experts by device offsets, where the recipe's
grouped GEMMs read them there (MOE034, `static_expert_rows`); one expert-parallel rank, or the all-to-all
under drop-and-pad, whose collectives (static splits, the ep group's own communicator) are captured with the
micro-batch (MOE058, `static_token_exchange`); a backend
that reads no counts on the host (MOE059). The first step runs eagerly (compiles, autotuning, lazily built
state); the capture happens at the first micro-batch of the next step, on a private memory pool.
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
from trainer.graphs.static_weights import StaticWeights
from trainer.moe.layer import MoELayer


class GraphCaptureError(MoectlError):
    """The step could not be captured into a CUDA graph (an operation that synchronises with the host)."""


@dataclass
class ReplayedLoss:
    """The loss parts a replay leaves in the graph's static output tensors (overwritten by the next replay)."""

    lm_loss: torch.Tensor
    aux_loss: torch.Tensor


class MicroBatchGraph:
    """Captures `loss_fn(tokens, targets)` and its backward (`total / n_micro`) once; replays it after.

    `model` is searched for MoE layers (their `stats`) and published quantized weights (pinned).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], Any], n_micro: int) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.n_micro = n_micro
        self.weights = StaticWeights(model)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tokens: torch.Tensor | None = None
        self.targets: torch.Tensor | None = None
        self.out: ReplayedLoss | None = None
        self._stats: list[tuple[nn.Module, Any]] = []
        self.replays = 0

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def refresh_weights(self) -> None:
        """Bring the pinned quantized weights up to the published ones (eagerly, before the step's replays)."""
        self.weights.refresh()

    def run(self, tokens: torch.Tensor, targets: torch.Tensor) -> ReplayedLoss:
        """Forward + backward of one micro-batch through the graph (captured on the first call)."""
        if self.graph is None:
            self._capture(tokens, targets)
        else:
            assert self.tokens is not None and self.targets is not None
            if tokens.shape != self.tokens.shape or targets.shape != self.targets.shape:
                raise GraphCaptureError(
                    f"a micro-batch of shape {tuple(tokens.shape)} after capturing {tuple(self.tokens.shape)}",
                    "CUDA graphs replay fixed shapes: keep train.micro_batch_size and model.seq_length fixed",
                )
            self.tokens.copy_(tokens, non_blocking=True)
            self.targets.copy_(targets, non_blocking=True)
        assert self.graph is not None and self.out is not None
        self.graph.replay()
        self.replays += 1
        for layer, stats in self._stats:  # an eager forward (eval) in between pointed them elsewhere
            layer.stats = stats
        return self.out

    def release_eager_graphs(self) -> None:
        """Drop what still holds an eager step's autograd graph: the MoE layers' `stats` (their aux losses).
        That graph keeps each param's grad accumulator alive, and autograd reuses a live accumulator in the
        next forward with the stream it was made on: the default stream, which a capture must not touch
        ("operation would make the legacy stream depend on a capturing blocking stream")."""
        for m in self.model.modules():
            if isinstance(m, MoELayer):
                m.stats = None
        gc.collect()

    def _capture(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        self.tokens, self.targets = tokens.clone(), targets.clone()
        self.release_eager_graphs()
        torch.cuda.synchronize()
        # Blocks the eager steps cached would otherwise sit beside the graph's private pool.
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        try:
            # A compiled region whose guards fail here would compile inside the capture, and inductor's
            # compile copies host tensors to the device, which a capture refuses. Such a region runs its
            # eager code into the graph instead (seen on an H100 when an earlier model of the same process
            # had left Dynamo entries with dynamic shapes whose guard failed at the capture).
            with torch.compiler.set_stance("eager_on_recompile"), torch.cuda.graph(graph):
                parts = self.loss_fn(self.tokens, self.targets)
                (parts.total / self.n_micro).backward()
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GraphCaptureError(
                f"train.cuda_graph: the micro-batch could not be captured at {_culprit(e)} ({first})",
                "set train.cuda_graph=false, and report the config: something in the step synchronises with the host",
            ) from e
        self.graph = graph
        self.out = ReplayedLoss(parts.lm_loss.detach(), parts.aux_loss.detach())
        self._stats = [(m, m.stats) for m in self.model.modules() if isinstance(m, MoELayer)]


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
    fp8 or fp8 tensorwise (e4m3 or hybrid), no delayed wgrad. Elsewhere `true` still works (the rules say
    what it needs); null does not take the chance: `torch._grouped_mm` keeps its group offsets on the device
    only for bf16 on sm90/sm100, and falls back to a loop that reads them on the host for fp32 params or
    older GPUs. The policy itself is `moectl.core.rules.null_graph_policy`, which MOE064 shares."""
    if cfg.train.cuda_graph is not None:
        return cfg.train.cuda_graph
    if device.type != "cuda":
        return False
    return null_graph_policy(cfg, (capability or torch.cuda.get_device_capability(device))[0])
