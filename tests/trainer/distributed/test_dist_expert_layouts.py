"""The two expert layouts in `DistributedModel`'s buffers: per-expert params (`weight0..`, `bias0..`) lie exactly
where the grouped `weight` `[E, out, in]` / `bias` `[E, out]` do (same start, experts 0..E-1 back to back,
one bucket), so after every backward the grad buffers of the two layouts are bitwise equal element for
element, and so are the grad norms summed over them, step after step: AdamW and layer-wise Muon, dp=1 and
dp=2 (and ep=2) on two gloo ranks, biases included, sizes that are multiples of 64 and sizes that are not;
except layer-wise Muon over 2+ ranks with experts that do not spread, placed expert by expert (`layerwise_layout`).

Before per-expert params were laid out as runs (they lay in reverse registration order, expert E-1 first, each
padded to 64 elements) every test here failed: the positions and grad buffers differ from the first backward,
and so did the grad norms, in their last bits, at every step of every one-rank case but one (Muon, "even",
per-expert weights and a grouped bias), and at all four steps of `test_trainer_grad_norms_are_bitwise_alike`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dist_helpers import run_distributed
from moectl.core.config.load import load_config
from moectl.core.config.schema import MoEConfig, OptimizerConfig, ParallelConfig
from trainer.distributed.layout import PARAM_ALIGN
from trainer.distributed.weight_sites import is_placeholder
from trainer.engine.distributed import DistributedEngine
from trainer.loop import Trainer
from trainer.moe.experts import GroupedMLP
from trainer.observer import SilentObserver
from trainer.parallel import ParallelState
from trainer.parallel.groups import build_parallel_state

E = 4
#: (hidden D, expert ffn F): fc1 `[2F, D]`, fc2 `[D, F]`, biases `2F` and `D` elements. (36, 20): 1440, 720, 40, 36,
#: none a multiple of 64 (old layout: padding between experts), never spread by Muon at dp=2. (32, 16): all
#: multiples of 64 but the biases, and Muon spreads both weights at dp=2.
SIZES = {"odd": (36, 20), "even": (32, 16)}
#: (single_grouped_weight, single_grouped_bias) of the layouts compared with the fully grouped one
LAYOUTS = {"per-expert": (False, False), "per-expert-weight": (False, True), "per-expert-bias": (True, False)}
COUNTS = [3, 1, 4, 2]  # rows per expert (one expert's rows each, as the dispatcher sorts them)


class Net(nn.Module):
    """Linear -> tanh -> the experts of one MoE layer (rows already sorted by expert) -> Linear."""

    def __init__(self, size: str, grouped_weight: bool, grouped_bias: bool, experts: int = E,
                 first_expert: int = 0, fusion: bool = False) -> None:
        super().__init__()
        D, F = SIZES[size]
        gen = torch.Generator().manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.out = nn.Linear(D, D)
        with torch.no_grad():
            for lin in (self.inp, self.out):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.2)
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen) * 0.1)
        cfg = MoEConfig(num_experts=E, ffn_hidden_size=F, add_bias=True, single_grouped_weight=grouped_weight,
                        single_grouped_bias=grouped_bias, backend="fused")
        self.experts = GroupedMLP(cfg, D, num_local_experts=experts, first_expert=first_expert, init_std=0.2,
                                  generator=torch.Generator().manual_seed(1), gradient_accumulation_fusion=fusion)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(self.experts(h, counts, probs) + h).square().mean()


def grouped_names(model: nn.Module) -> dict[str, list[str]]:
    """Each param's name in the fully grouped layout -> its names here (per-expert params in expert order)."""
    out: dict[str, list[str]] = {}
    for n, _ in model.named_parameters():
        stem = n.rstrip("0123456789") if ".experts." in f".{n}" else n
        out.setdefault(stem, []).append(n)
    return {k: sorted(v, key=lambda n: int(n[len(k):] or 0)) for k, v in out.items()}


def ranges_by_name(engine: DistributedEngine) -> dict[str, tuple[int, int, int]]:
    """name -> (buffer index, start, end) of every param."""
    return {b.names[p]: (k, *b.param_ranges[p]) for k, b in enumerate(engine.dmodel.buffers) for p in b.params}


def buckets_by_name(engine: DistributedEngine) -> dict[str, tuple[int, int]]:
    return {b.buffer.names[p]: (k, b.index) for k, buf in enumerate(engine.dmodel.buffers) for b in buf.buckets
            for p in b.params}


def same_positions(grouped: DistributedEngine, other: DistributedEngine) -> list[str]:
    """Names (in `other`) whose buffer, range or bucket is not the grouped tensor's slice of that expert."""
    ref, got = ranges_by_name(grouped), ranges_by_name(other)
    ref_b, got_b = buckets_by_name(grouped), buckets_by_name(other)
    bad = []
    for stem, names in grouped_names(other.model).items():
        buf, start, end = ref[stem]
        step = (end - start) // len(names)
        if len(names) > 1 and start % PARAM_ALIGN:
            bad.append(stem)
        for e, n in enumerate(names):
            if got[n] != (buf, start + e * step, start + (e + 1) * step) or got_b[n] != ref_b[stem]:
                bad.append(n)
    return bad


def batch(step: int, rank: int, D: int, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    counts = COUNTS[:experts]
    rows = sum(counts)
    return torch.randn(rows, D, generator=gen), torch.tensor(counts), torch.rand(rows, generator=gen) + 0.5


def train(model: Net, engine: DistributedEngine, steps: int, rank: int = 0) -> dict[str, Any]:
    """`steps` steps; per step the grad buffers after the backward and their reduce (cloned: an overlapped reduce
    may still be writing them when the backward returns) and the reported grad norm."""
    D, experts = model.inp.in_features, model.experts.num_local_experts
    grads, norms = [], []
    for step in range(steps):
        engine.zero_grad()
        x, counts, probs = batch(step, rank, D, experts)
        model(x, counts, probs).backward()
        engine.finish_grad_sync()
        grads.append([b.grad_data.clone() for b in engine.dmodel.buffers])
        norms.append(engine.step(1e-2).grad_norm)
    engine.sync_params_for_eval()
    return {"grads": grads, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def engine_for(model: Net, optimizer: str, pstate: ParallelState, bucket_size: int,
               distributed: bool = True) -> DistributedEngine:
    # clip_grad tiny: every step clips, so the norm reaches the update
    return DistributedEngine(model, ParallelConfig(bucket_size=bucket_size, use_distributed_optimizer=distributed),
                             OptimizerConfig(optimizer=optimizer, lr=1e-2, clip_grad=1e-3), pstate)


def compare(layout: str, size: str, optimizer: str, bucket_size: int, pstate: ParallelState, rank: int = 0,
            ep: int = 1, fusion: bool = False, distributed: bool = True, steps: int = 3) -> dict[str, Any]:
    """Both layouts (fully grouped and `layout`) trained alike: what differs between them (all empty/True when
    bitwise alike)."""
    local = E // ep
    runs = {}
    for name, (gw, gb) in {"grouped": (True, True), layout: LAYOUTS[layout]}.items():
        model = Net(size, gw, gb, experts=local, first_expert=rank % ep * local if ep > 1 else 0, fusion=fusion)
        engine = engine_for(model, optimizer, pstate, bucket_size, distributed)
        runs[name] = (engine, train(model, engine, steps, rank))
    (g_engine, g), (o_engine, o) = runs["grouped"], runs[layout]
    stacked = {stem: torch.stack([o["params"][n] for n in names]) if len(names) > 1 else o["params"][names[0]]
               for stem, names in grouped_names(o_engine.model).items()}
    owners = {}
    if optimizer == "muon" and distributed:  # which ranks step each fc1 expert (layer-wise Muon)
        own = o_engine.optimizer.members[0].ownership()  # type: ignore[union-attr]
        owners = {n: own[n] for n in grouped_names(o_engine.model)["experts.linear_fc1.weight"]}
    return {
        "positions": same_positions(g_engine, o_engine),
        "owners": owners,
        "grads": all(len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
                     for a, b in zip(g["grads"], o["grads"])),
        "norms": (g["norms"], o["norms"]),
        "params": [n for n, p in g["params"].items() if not torch.equal(p, stacked[n])],
        "buckets": sum(len(b.buckets) for b in g_engine.dmodel.buffers),
    }


def check(result: dict[str, Any], what: Any) -> None:
    assert result["positions"] == [], (what, result["positions"])
    assert result["grads"], what
    norms, other = result["norms"]
    assert norms == other, (what, norms, other)
    assert result["params"] == [], (what, result["params"])


# ------------------------------------------------------------------------------------------ one rank
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_layouts_share_grad_buffers_and_norms_on_one_rank(optimizer: str, layout: str, size: str) -> None:
    for bucket_size in (10**6, 1000):  # one bucket; buckets that would close inside the experts without runs
        result = compare(layout, size, optimizer, bucket_size, ParallelState.trivial())
        check(result, (bucket_size, result["norms"]))
        if bucket_size == 1000:
            assert result["buckets"] > 3


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_fused_wgrad_into_main_grad_shares_them_too(optimizer: str) -> None:
    """Gradient-accumulation fusion: the backend adds the weight grads into the buffers' views itself."""
    check(compare("per-expert", "odd", optimizer, 1000, ParallelState.trivial(), fusion=True), optimizer)


def test_frozen_experts_leave_the_rest_of_the_run_back_to_back() -> None:
    model = Net("odd", False, False)
    model.experts.linear_fc1.weight1.requires_grad_(False)
    engine = engine_for(model, "adam", ParallelState.trivial(), 10**6)
    ranges = ranges_by_name(engine)
    run = [ranges[f"experts.linear_fc1.weight{e}"] for e in (0, 2, 3)]
    assert run[0][1] % PARAM_ALIGN == 0 and run[0][2] == run[1][1] and run[1][2] == run[2][1]
    assert "experts.linear_fc1.weight1" not in ranges


_REAL = [
    "model.num_layers=2", "model.hidden_size=36", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=32", "model.vocab_size=256", "moe.num_experts=4", "moe.ffn_hidden_size=20",
    "moe.add_bias=true", "train.micro_batch_size=2", "train.global_batch_size=4", "data.source=synthetic",
    "train.eval_interval=null", "optimizer.lr_warmup_iters=0", "optimizer.clip_grad=1e-3", "logging.jsonl=false",
]  # fmt: skip


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_trainer_grad_norms_are_bitwise_alike(tmp_path: Path, optimizer: str) -> None:
    """The real model and loop: every step's grad norm and loss, and the final masters and params, grouped vs
    per-expert (`_train_both_layouts`)."""
    _train_both_layouts(tmp_path, [*_REAL, f"optimizer.optimizer={optimizer}"])


_GPU_CASES = {  # the CUDA paths the runs reach: the wgrad kernels' targets, grad_sq partials, CUDA graphs, param gather
    "bf16": ["model.hidden_size=64", "mixed_precision.bf16=true", "moe.ffn_hidden_size=40"],
    "defer": ["model.hidden_size=64", "mixed_precision.bf16=true", "moe.ffn_hidden_size=40",
              "moe.defer_expert_wgrad=true"],
    "fp8-param-gather": ["model.hidden_size=64", "mixed_precision.bf16=true", "moe.ffn_hidden_size=48",
                         "moe.add_bias=false", "mixed_precision.fp8=e4m3", "mixed_precision.fp8_param_gather=true"],
    "mxfp8-param-gather": ["model.hidden_size=64", "mixed_precision.bf16=true", "moe.ffn_hidden_size=64",
                           "moe.add_bias=false", "mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=mxfp8",
                           "mixed_precision.fp8_param_gather=true",
                           "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true"],
}  # fmt: skip
_GPU_RUNS = [(o, c) for o in ("adam", "muon") for c in _GPU_CASES
             if (o, c) != ("muon", "fp8-param-gather")]  # MOE010: Muon gathers mxfp8 only


def _train_both_layouts(tmp_path: Path, sets: list[str]) -> None:
    """4 steps of the real Trainer in each layout: equal losses and grad norms at every step, and equal fp32
    masters and params at the end (a param gather's quantized weights keep no bf16 values: only their masters)."""
    out = {}
    for grouped in ("true", "false"):
        cfg = load_config(None, [*sets, f"moe.single_grouped_weight={grouped}", f"moe.single_grouped_bias={grouped}",
                                 f"run_dir={tmp_path / grouped}"])  # fmt: skip
        trainer = Trainer(cfg, SilentObserver())
        records = [trainer.train_step(step) for step in range(4)]
        trainer.engine.sync_params_for_eval()
        masters = {n: e["master"].cpu() for n, e in trainer.engine.optimizer.gather_logical_state()["params"].items()}
        params = {n: p.detach().float().cpu() for n, p in trainer.model.named_parameters() if not is_placeholder(p)}
        out[grouped] = ([(float(r["loss"]), float(r["grad_norm"])) for r in records], grouped_names(trainer.model),
                        masters, params)  # fmt: skip
    assert out["true"][0] == out["false"][0]
    (_, _, masters, params), (_, names, other_masters, other_params) = out["true"], out["false"]
    for stem, members in names.items():
        for mine, theirs, what in ((masters, other_masters, "master"), (params, other_params, "param")):
            assert (stem in mine) == all(n in theirs for n in members), (what, stem)
            if stem in mine:
                got = torch.stack([theirs[n] for n in members]) if len(members) > 1 else theirs[members[0]]
                assert torch.equal(mine[stem], got), (what, stem)


def test_trainer_layouts_with_mxfp8_param_gather_are_bitwise_alike(tmp_path: Path) -> None:
    """The GPU test's param gather case on the CPU (MXFP8 emulated), Muon, where the masters are what is compared."""
    _train_both_layouts(tmp_path, [*_REAL, *_GPU_CASES["mxfp8-param-gather"], "optimizer.optimizer=muon"])


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer, case", _GPU_RUNS)
def test_trainer_layouts_are_bitwise_alike_on_the_gpu(tmp_path: Path, optimizer: str, case: str) -> None:
    """`test_trainer_grad_norms_are_bitwise_alike` on CUDA with the trainer's defaults there (CUDA graphs, the
    Triton wgrad and AdamW kernels, the grad norm from the wgrad's partials), deferred expert wgrads, and fp8 /
    MXFP8 param gather. Device tool, one H200 (torch 2.11): the losses and grad norms were equal in every case,
    and the params in the four without param gather; the param gather cases compared the quantized weights'
    placeholders (NaN), so they compare masters now."""
    _train_both_layouts(tmp_path, [*_REAL, *_GPU_CASES[case], "model.seq_length=64", "train.global_batch_size=8",
                                   "train.device=cuda", "optimizer.optimizer=" + optimizer,
                                   "train.compile=none"])  # compiling takes most of the time, and is layout-blind


# ------------------------------------------------------------------------------------------ two ranks
def _two_rank_body(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    dp = build_parallel_state(1)
    ep = build_parallel_state(2)
    results = {}
    for optimizer in ("adam", "muon"):
        for size in SIZES:
            for bucket_size in (10**6, 1000):
                results[(optimizer, size, "dp2", bucket_size)] = compare("per-expert", size, optimizer, bucket_size,
                                                                          dp, rank)
        results[(optimizer, "odd", "ddp", 1000)] = compare("per-expert-bias", "odd", optimizer, 1000, dp, rank,
                                                           distributed=False)
        results[(optimizer, "odd", "ep2", 1000)] = compare("per-expert", "odd", optimizer, 1000, ep, rank, ep=2)
    return results


@pytest.mark.slow
def test_layouts_share_grad_buffers_and_norms_on_two_ranks() -> None:
    """dp=2 (distributed optimizer: reduce-scatter, sharded Adam, layer-wise Muon spreading expert slices),
    plain DDP, and ep=2 (each rank's two experts a run): bitwise alike on each rank. The one exception is
    layer-wise Muon with experts that do not spread ("odd": two slices are no whole 128 elements): the grouped
    weight is whole on one rank, the per-expert matrices are placed one by one over both (`layerwise_layout`),
    so their positions differ and the norms agree to fp32 rounding only."""
    for rank, results in enumerate(run_distributed(_two_rank_body, world_size=2, timeout=300)):
        assert len(results) == 12
        for what, result in results.items():
            if what[:3] == ("muon", "odd", "dp2"):
                norms, other = result["norms"]
                assert result["positions"] and norms == pytest.approx(other, rel=1e-6), (rank, what, norms, other)
                continue
            check(result, (rank, what, result["norms"]))
        for bucket_size in (10**6, 1000):  # Muon spreads the "even" experts; the "odd" ones go to both ranks
            assert sorted(results[("muon", "even", "dp2", bucket_size)]["owners"].values()) == [(0,), (0,), (1,), (1,)]
            assert len(set(results[("muon", "odd", "dp2", bucket_size)]["owners"].values())) == 2
