"""A tiny model with dense and expert params, and a training harness over `trainer.distributed` (tests only).

`ToyMoE`: Linear -> LayerNorm -> an "expert" block with one `[E, out, in]` weight and an `[E, out]` bias
(both `expert_parallel`) -> Linear. `train()` runs whole short trainings (micro-batches, no_sync, grad
sync, optimizer step, optional eval) on any ParallelState, so the same code gives the dp=1 reference
and each dp=2 rank's run. Every rank of a dp group sees a disjoint slice of the same global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from moectl.core.config.schema import OptimizerConfig, ParallelConfig
from trainer.distributed import DistributedModel, ParamStorage
from trainer.parallel import ParallelState
from trainer.distributed.bucket import Bucket
from trainer.parallel.groups import dense_seed, expert_seed
from trainer.optim.distributed_optimizer import DistributedOptimizer

D_IN, D, E, D_OUT = 8, 16, 3, 4


class ExpertBlock(nn.Module):
    def __init__(self, gen: torch.Generator, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter((torch.randn(E, D, D, generator=gen) * 0.3).to(dtype))
        self.bias = nn.Parameter((torch.randn(E, D, generator=gen) * 0.1).to(dtype))
        for p in (self.weight, self.bias):
            p.expert_parallel = True  # type: ignore[attr-defined]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = torch.einsum("bi,eoi->beo", h, self.weight) + self.bias
        return torch.relu(y).mean(dim=1)


class ToyMoE(nn.Module):
    def __init__(self, seed: int = 0, expert_seed_value: int | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(D_IN, D, dtype=dtype)
        self.norm = nn.LayerNorm(D, dtype=dtype)
        self.out = nn.Linear(D, D_OUT, dtype=dtype)
        with torch.no_grad():
            for lin in (self.inp, self.out):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.3)
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen) * 0.1)
        egen = torch.Generator().manual_seed(seed + 1 if expert_seed_value is None else expert_seed_value)
        self.experts = ExpertBlock(egen, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.inp(x)))
        return self.out(self.experts(h) + h)


class ByteStorage(ParamStorage):
    """A stand-in for a quantized recipe (tests only): the param buffer holds one float8 byte per element.

    The param keeps its own (dequantized) storage for compute; the all-gather ships bytes; post_gather
    dequantizes them into the param. The high-precision init values are kept on the CPU at bind time and
    are what masters are built from; `release_init_source` frees them. What the real recipes add is
    scales, rowwise/columnwise copies and native GEMMs, not new hooks.
    """

    def __init__(self) -> None:
        self.init_values: dict[nn.Parameter, torch.Tensor] = {}

    @property
    def key(self) -> str:
        return "bytes:float8_e4m3fn"

    def storage_dtype(self, param: nn.Parameter) -> torch.dtype:
        return torch.uint8

    def buffer_dtype(self, param: nn.Parameter) -> torch.dtype:
        return torch.uint8

    @staticmethod
    def quantize(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float8_e4m3fn).view(torch.uint8)

    def bind(self, param: nn.Parameter, view: torch.Tensor) -> None:
        self.init_values[param] = param.detach().to("cpu", copy=True)
        with torch.no_grad():
            view.copy_(self.quantize(param.detach().reshape(-1)))
            param.copy_(view.view(torch.float8_e4m3fn).to(param.dtype).view(param.shape))  # the model is low precision

    def stage(self, bucket: Bucket, lo: int, hi: int, master: torch.Tensor) -> None:
        bucket.param_data[lo:hi].copy_(self.quantize(master))

    def post_gather(self, bucket: Bucket) -> None:
        for p in bucket.params:
            s, e = bucket.param_ranges[p]
            p.detach().copy_(bucket.param_data[s:e].view(torch.float8_e4m3fn).to(p.dtype).view(p.shape))

    def init_source(self, param: nn.Parameter) -> torch.Tensor:
        return self.init_values[param]

    def release_init_source(self, param: nn.Parameter) -> None:
        self.init_values.pop(param, None)

    def replica_tensors(self, param: nn.Parameter) -> list[torch.Tensor]:
        return [param.data, self.init_values[param]]


def global_batch(step: int, rows: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, D_IN, generator=g).to(dtype), torch.randn(rows, D_OUT, generator=g).to(dtype)


@dataclasses.dataclass
class Run:
    """Knobs of one training run."""

    steps: int = 4
    n_micro: int = 2  # per rank
    rows_per_micro: int = 3
    lr: float = 0.05
    clip_grad: float = 0.5
    eval_after: tuple[int, ...] = ()  # steps (0-based) after which to evaluate
    force_sync_before_forward: bool = False
    dtype: torch.dtype = torch.float32
    seed: int = 0
    on_nonfinite: str = "stop"
    fused: bool | None = None


def make(pstate: ParallelState, pcfg: ParallelConfig, run: Run,
         storage: Callable[[str, nn.Parameter], ParamStorage] | None = None
         ) -> tuple[ToyMoE, DistributedModel, DistributedOptimizer]:
    model = ToyMoE(dense_seed(run.seed, pstate), expert_seed(run.seed, pstate) if pstate.ep.size > 1 else None,
                   dtype=run.dtype)
    dm = DistributedModel(model, pcfg, pstate, storage=storage)
    dm.broadcast_params()
    opt = DistributedOptimizer(dm, OptimizerConfig(lr=run.lr, clip_grad=run.clip_grad, weight_decay=0.1),
                               on_nonfinite=run.on_nonfinite, fused=run.fused)  # type: ignore[arg-type]
    return model, dm, opt


def forward_backward(dm: DistributedModel, pstate: ParallelState, run: Run, step: int) -> float:
    """All micro-batches of this rank for `step`; returns the summed (scaled) local loss."""
    dp, r = pstate.dp.size, pstate.dp.rank
    per_rank = run.n_micro * run.rows_per_micro
    x, y = global_batch(step, per_rank * dp, run.dtype)
    x, y = x[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank]
    total = 0.0
    for i in range(run.n_micro):
        sl = slice(i * run.rows_per_micro, (i + 1) * run.rows_per_micro)
        ctx = dm.no_sync() if i < run.n_micro - 1 else contextlib.nullcontext()
        with ctx:
            loss = ((dm(x[sl]) - y[sl]).float() ** 2).mean() / run.n_micro
            loss.backward()
        total += float(loss.detach())
    return total


def evaluate(dm: DistributedModel, run: Run) -> float:
    dm.force_param_sync()
    x, y = global_batch(999, 8, run.dtype)
    with torch.no_grad():
        return float(((dm(x) - y).float() ** 2).mean())


def train(pstate: ParallelState, pcfg: ParallelConfig, run: Run,
          storage: Callable[[str, nn.Parameter], ParamStorage] | None = None) -> dict[str, Any]:
    """Train; return per-step grad norms and local losses, eval losses, final params and logical state."""
    model, dm, opt = make(pstate, pcfg, run, storage)
    norms, losses, evals = [], [], []
    for step in range(run.steps):
        dm.zero_grad_buffer()
        if run.force_sync_before_forward:
            dm.force_param_sync()
        losses.append(forward_backward(dm, pstate, run, step))
        dm.finish_grad_sync()
        norms.append(opt.step(run.lr).grad_norm)
        if step in run.eval_after:
            evals.append(evaluate(dm, run))
    dm.force_param_sync()
    return {
        "norms": norms,
        "losses": losses,
        "evals": evals,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "state": opt.gather_logical_state(),
        "hash_mismatches": dm.check_param_hashes(),
    }


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max|a-b| / max|b| (keys must match)."""
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    worst = 0.0
    for k in a:
        scale = float(b[k].abs().max()) or 1.0
        worst = max(worst, float((a[k].float() - b[k].float()).abs().max()) / scale)
    return worst


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def state_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": t for n, entry in state["params"].items() for k, t in entry.items()}
