"""Short training runs of the real GPT-MoE through `DistributedEngine`, for the param-gather acceptance tests.

`train(Knobs(...), pstate)` builds a tiny 2-layer model (one MoE layer, one dense layer: attention,
dense MLP and expert linears all run through the recipe), wraps it as `trainer.build` does (the recipe in
the model, param-gather storage into the engine), trains a few steps on batches that are a pure function
of (step, rank), and returns what the acceptance tests compare:

    losses     every step's loss (one micro-batch per step unless `n_micro`), as floats
    evals      eval losses (no grad, after `sync_params_for_eval`) after the steps in `eval_after`
    masters    fp32 masters at the end, by layout-free name (`weight0..` stacked into `weight`)
    grads      main grads of the last step (after the reduce, before the optimizer), layout-free
    weights    what the forward computes with at the end, layout-free: for recipe-run weights the
               quantized bytes (`QuantizedTensor.to_bytes`: rowwise + columnwise data and scales),
               live ones with param gather, `recipe.quantize_weight(param)` without; else the param
    history    per step, the quantized bytes of the expert fc1 weight that step's forward used
    hashes     `check_param_hashes()` at the end (names differing across dp replicas)

Layout-free names make single-grouped and per-expert runs comparable key by key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from moectl.core.config.schema import Config, ParallelConfig
from trainer.parallel import ParallelState
from trainer.engine.distributed import DistributedEngine
from trainer.distributed.param_gather import param_gather_storage
from trainer.distributed.quantized_storage import quantized_storage_of
from trainer.model import GPTMoE
from trainer.moe.experts import GroupedLinearParams
from trainer.precision import QuantizedTensor, get_recipe

RECIPES = ("bf16", "tensorwise", "delayed", "blockwise", "mxfp8", "nvfp4")
_MEMBER = re.compile(r"^(?P<stem>.+\.(?:weight|bias))(?P<index>\d+)$")


@dataclass(frozen=True)
class Knobs:
    recipe: str = "mxfp8"
    gather: bool = True  # fp8/fp4 param gather (bf16: the distributed optimizer's bf16 gather vs plain DDP)
    grouped: bool = True  # single grouped expert weights, else per-expert
    fuse: bool = False  # gradient_accumulation_fusion
    overlap: bool = False  # overlap_grad_reduce + overlap_param_gather
    reuse: bool = True  # reuse_grad_buf_for_mxfp8_param_ag (mxfp8 with gather)
    steps: int = 3
    n_micro: int = 1
    eval_after: tuple[int, ...] = ()  # 0-based steps after which to evaluate
    seed: int = 7

    def describe(self) -> str:
        return (f"{self.recipe} gather={self.gather} {'grouped' if self.grouped else 'per-expert'} "
                f"fuse={self.fuse} overlap={self.overlap}")  # fmt: skip


def config(k: Knobs) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups = 2, 32, 2, 1
    m.ffn_hidden_size, m.seq_length, m.vocab_size, m.moe_layer_freq = 32, 16, 256, [1, 0]
    cfg.moe.num_experts, cfg.moe.router_topk, cfg.moe.ffn_hidden_size = 4, 2, 32
    if k.recipe == "blockwise":  # 128x128 weight blocks: GEMM dims in multiples of 128 (rule MOE006)
        m.hidden_size = m.ffn_hidden_size = cfg.moe.ffn_hidden_size = 128
    cfg.moe.single_grouped_weight, cfg.moe.backend = k.grouped, "grouped"
    mp = cfg.mixed_precision
    mp.bf16 = True
    if k.recipe == "nvfp4":
        mp.fp4, mp.fp4_param_gather = "e2m1", k.gather
    elif k.recipe != "bf16":
        mp.fp8, mp.fp8_recipe, mp.fp8_param_gather = "e4m3", k.recipe, k.gather
        mp.reuse_grad_buf_for_mxfp8_param_ag = k.gather and k.reuse and k.recipe == "mxfp8"
    cfg.parallel = ParallelConfig(
        gradient_accumulation_fusion=k.fuse, overlap_grad_reduce=k.overlap, overlap_param_gather=k.overlap,
        use_distributed_optimizer=k.gather or k.recipe != "bf16",
    )  # fmt: skip
    cfg.optimizer.lr, cfg.optimizer.lr_warmup_iters = 3e-3, 0
    return cfg


def build(k: Knobs, pstate: ParallelState) -> tuple[GPTMoE, DistributedEngine, Config]:
    """The model and engine as `trainer.build` makes them (recipe in the model, storage into the engine)."""
    cfg = config(k)
    recipe = get_recipe(cfg.mixed_precision)
    model = GPTMoE(cfg.model, cfg.moe, seed=k.seed, params_dtype=torch.bfloat16,
                   gradient_accumulation_fusion=k.fuse, recipe=recipe,
                   expert_align=recipe.align_size if recipe is not None else 1).to(pstate.device)  # fmt: skip
    storage = param_gather_storage(model, cfg.mixed_precision, recipe)
    engine = DistributedEngine(model, cfg.parallel, cfg.optimizer, pstate, storage=storage)
    return model, engine, cfg


def batch(step: int, rank: int, micro: int, rows: int = 2, seq: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randint(0, 256, (rows, seq + 1), generator=g)


def layout_free(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`...weight0..weight{E-1}` stacked into `...weight` (and biases alike); other names unchanged."""
    out: dict[str, torch.Tensor] = {}
    members: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in named.items():
        m = _MEMBER.match(name)
        if m and ".experts." in name:
            members.setdefault(m["stem"], {})[int(m["index"])] = t
        else:
            out[name] = t
    for stem, parts in members.items():
        out[stem] = torch.stack([parts[i] for i in range(len(parts))])
    return out


def effective_weights(model: GPTMoE) -> dict[str, torch.Tensor]:
    """What the forward uses, layout-free (see the module docstring)."""
    out: dict[str, torch.Tensor] = {}
    sited: set[int] = set()
    for mname, mod in model.named_modules():
        recipe = getattr(mod, "recipe", None)
        if isinstance(mod, GroupedLinearParams):
            recipe = model.recipe
        if recipe is None or not hasattr(mod, "quantized_weight"):
            continue
        if isinstance(mod, GroupedLinearParams):
            params = mod.weight_params()
            hp = params[0] if mod.grouped_weight else torch.stack(params)
        else:
            params = [mod.weight]
            hp = mod.weight
        sited.update(id(p) for p in params)
        qt = mod.quantized_weight
        if qt is None:
            if recipe.name == "delayed":
                continue  # needs the layer's history; delayed runs compare masters and losses
            qt = recipe.quantize_weight(hp.detach(), rowwise=True, columnwise=True)
        out[mname + ".weight"] = with_both_copies(qt).to_bytes().clone()
    plain = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in sited}
    out.update(layout_free(plain))
    return out


def with_both_copies(qt: QuantizedTensor) -> QuantizedTensor:
    """`qt` with its columnwise copy: per-tensor FP8 param gather publishes rowwise only and the backward
    builds the exact transpose at its first use; build it here on a shallow copy (the live one is left as is),
    so live weights compare with quantizing both copies at once whenever the backward has run or not."""
    if qt.columnwise is None and qt.scheme.transposable:
        return replace(qt).with_columnwise()
    return qt


def expert_fc1_bytes(model: GPTMoE) -> torch.Tensor:
    fc1 = model.moe_layers()[0].experts.linear_fc1
    qt = fc1.quantized_weight
    assert qt is not None, "no quantized expert weight"
    return with_both_copies(qt).to_bytes().clone()


@dataclass
class Result:
    knobs: Knobs
    losses: list[float] = field(default_factory=list)
    evals: list[float] = field(default_factory=list)
    masters: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    history: list[torch.Tensor] = field(default_factory=list)
    hashes: list[str] = field(default_factory=list)


def train(k: Knobs, pstate: ParallelState, *, after_step: Optional[Callable[[int, Any], None]] = None) -> Result:
    """Run `k.steps` steps (see the module docstring); `after_step(step, engine)` runs after each step."""
    model, engine, _ = build(k, pstate)
    res = Result(k)
    rank = pstate.dp.rank
    for step in range(k.steps):
        engine.zero_grad()
        total = 0.0
        for micro in range(k.n_micro):
            tokens = batch(step, rank, micro).to(pstate.device)
            with engine.micro_batch(is_last=micro == k.n_micro - 1):
                loss = model.loss(tokens[:, :-1], tokens[:, 1:]).total / k.n_micro
                loss.backward()
            total += loss.item()
        res.losses.append(total)
        if model.moe_layers()[0].experts.linear_fc1.quantized_weight is not None:
            res.history.append(expert_fc1_bytes(model).cpu())  # the expert weight this step's forward used
        engine.dmodel.finish_grad_sync()
        if step == k.steps - 1:
            res.grads = layout_free({n: p.main_grad.detach().cpu().clone() for n, p in model.named_parameters()})
        result = engine.step(3e-3)
        assert not result.skipped
        if after_step is not None:
            after_step(step, engine)
        if step in k.eval_after:
            engine.sync_params_for_eval()
            with torch.no_grad():
                tokens = batch(1000 + step, rank, 0).to(pstate.device)
                res.evals.append(model.loss(tokens[:, :-1], tokens[:, 1:]).total.item())
    engine.sync_params_for_eval()
    state = engine.optimizer.gather_logical_state()["params"]
    res.masters = layout_free({n: e["master"].cpu() for n, e in state.items()})
    res.weights = {n: t.cpu() for n, t in effective_weights(model).items()}
    res.hashes = engine.dmodel.check_param_hashes()
    return res


def with_(k: Knobs, **kw: Any) -> Knobs:
    return replace(k, **kw)


def differences(a: Result, b: Result, *, grads: bool = True, weights: bool = True) -> list[str]:
    """What differs bitwise between two runs (empty when identical): losses, evals, masters, grads, weights."""
    out = []
    if a.losses != b.losses:
        out.append(f"losses {a.losses} != {b.losses}")
    if a.evals != b.evals:
        out.append(f"evals {a.evals} != {b.evals}")
    for what, x, y in (("master", a.masters, b.masters), ("grad", a.grads, b.grads), ("weight", a.weights, b.weights)):
        if (what == "grad" and not grads) or (what == "weight" and not weights):
            continue
        if x.keys() != y.keys():
            out.append(f"{what} names differ: {sorted(x.keys() ^ y.keys())}")
            continue
        out += [f"{what} {n}" for n in sorted(x) if not torch.equal(x[n], y[n])]
    return out


def quantized_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if quantized_storage_of(p) is not None]
