"""`DistributedEngine`: the loop's `Engine` (`protocol.py`) over DistributedModel + DistributedOptimizer.

It wraps the single-device model in place (buffers, hooks), broadcasts dp replicas' params from their
first rank, and builds the AdamW `DistributedOptimizer` on the "adam" tag; with `optimizer: muon`, a
`ChainedOptimizer` of layer-wise Muon (matrices, tag "muon") and that AdamW (the rest). The loop keeps
calling the model itself (`model.loss(...)`): the wrapper's hooks live on the model's modules. Per step:

    engine.zero_grad()                          -> zero_grad_buffer (re-stages aliased staging)
    with engine.micro_batch(is_last=...): ...   -> no_sync() on all micro-batches but the last
    engine.start_grad_sync()                    -> launch what no backward launched (CUDA-graph steps
                                                   whose graphs do not hold the reductions)
    engine.step(lr, loss)                       -> finish_grad_sync, then optimizer.step (loss in the verdict)
    engine.sync_params_for_eval()               -> force_param_sync (eval, checkpoint, exit)
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Literal

import torch
from torch import nn

from moectl.core.config.schema import OptimizerConfig, ParallelConfig
from moectl.core.errors import ConfigError
from moectl.core.overlap import overlap_policy
from trainer.distributed.ddp import DistributedModel, StorageSpec
from trainer.parallel.groups import ParallelState
from trainer.switches import switched_off
from trainer.distributed.quantized_storage import quantized_storage_of
from trainer.optim.chained import ChainedOptimizer, build_muon_optimizer
from trainer.optim.distributed_optimizer import DistributedOptimizer
from trainer.optim.muon_routing import muon_model_options
from trainer.optim.step_result import StepResult


class DistributedEngine:
    def __init__(self, model: nn.Module, parallel_cfg: ParallelConfig, optimizer_cfg: OptimizerConfig,
                 pstate: ParallelState, on_nonfinite: Literal["stop", "skip"] = "stop",
                 storage: StorageSpec = None) -> None:
        if optimizer_cfg.optimizer not in ("adam", "muon"):
            raise ConfigError("optimizer.optimizer", optimizer_cfg.optimizer,
                              "the distributed engine implements AdamW and Muon", fix="set optimizer.optimizer=adam")
        # null overlap flags: on under data parallelism (the same resolution the rules check)
        grad, gather = overlap_policy(parallel_cfg, pstate.dp.size)
        parallel_cfg = dataclasses.replace(parallel_cfg, overlap_grad_reduce=grad, overlap_param_gather=gather)
        muon = optimizer_cfg.optimizer == "muon"
        # Muon: matrices tagged "muon" in layer-wise buffers (whole matrices per rank), the rest "adam".
        options = (muon_model_options(parallel_cfg.use_distributed_optimizer, optimizer_cfg.muon_split_glu,
                                      optimizer_cfg.muon_split_qkv) if muon else {})
        self.dmodel = DistributedModel(model, parallel_cfg, pstate, storage=storage, **options)
        self.dmodel.broadcast_params()
        self.optimizer: DistributedOptimizer | ChainedOptimizer = (
            build_muon_optimizer(self.dmodel, optimizer_cfg, on_nonfinite) if muon
            else DistributedOptimizer(self.dmodel, optimizer_cfg, on_nonfinite=on_nonfinite)
        )

    def zero_grad(self) -> None:
        self.dmodel.zero_grad_buffer()

    def micro_batch(self, is_last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if is_last else self.dmodel.no_sync()

    def start_grad_sync(self) -> None:
        self.dmodel.start_grad_sync()

    @property
    def reduces_in_graph(self) -> bool:
        """Data parallel grads are reduced inside the last micro-batch's CUDA graph, overlapping its backward
        under `overlap_grad_reduce` (dp=4, reference config: docs/benchmarks.md, seventeenth session).
        `MOECTL_GRAPH_GRAD_SYNC=0` launches them after the last replay instead, the A/B switch."""
        return self.dmodel.reduces_grads and not switched_off("MOECTL_GRAPH_GRAD_SYNC")

    def finish_grad_sync(self) -> None:
        self.dmodel.finish_grad_sync()

    @property
    def grads_final_after_backward(self) -> bool:
        """One data-parallel rank: no reduce and no 1/dp scale touch the grads after the backward."""
        return self.dmodel.pstate.dp.size == 1

    def grads_reduced_by_replay(self) -> None:
        self.dmodel.mark_grads_reduced()

    @property
    def gathers_in_graph(self) -> bool:
        """With `overlap_param_gather` and high-precision params, the first micro-batch's CUDA graph holds
        the param all-gathers, each launched by a forward pre-hook one group ahead, as eagerly.
        `MOECTL_GRAPH_PARAM_GATHER=0` finishes them before the step instead, the A/B switch."""
        return self.dmodel.gathers_in_graph and not switched_off("MOECTL_GRAPH_PARAM_GATHER")

    def stage_for_graph_gather(self) -> None:
        self.dmodel.stage_for_graph_gather()

    def params_gathered_by_replay(self) -> None:
        self.dmodel.mark_params_gathered()

    def step(self, lr: float, loss: torch.Tensor | None = None) -> StepResult:
        self.dmodel.finish_grad_sync()
        return self.optimizer.step(lr, loss=loss)

    def sync_params_for_eval(self) -> None:
        self.dmodel.force_param_sync()

    @property
    def step_count(self) -> int:
        return self.optimizer.step_count

    @property
    def model(self) -> nn.Module:
        return self.dmodel.module

    def state_keys(self, name: str) -> tuple[str, ...]:
        return self.optimizer.state_keys(name)

    def logical_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer's gathered state per param, plus the weight: the param itself, or - under fp8/fp4
        param gather, where the model holds only quantized bytes - the master cast to the param dtype, which
        is what a run without param gather would hold (quantized bytes are never saved)."""
        self.sync_params_for_eval()  # params equal the masters, with any deferred gather finished
        state = self.optimizer.gather_logical_state()["params"]
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self.dmodel.module.named_parameters():
            entry = dict(state[name])
            stored = quantized_storage_of(p) is not None
            entry["param"] = entry["master"].to(p.dtype) if stored else p.detach()
            out[name] = entry
        return out

    def load_logical_state(self, params: dict[str, dict[str, torch.Tensor]], step: int | None) -> None:
        state: dict[str, object] = {"params": params}
        if step is not None:
            state["step"] = step
        self.optimizer.load_logical_state(state)
