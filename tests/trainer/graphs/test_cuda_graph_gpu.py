"""`train.cuda_graph` replays each micro-batch bitwise like the eager step (issue 15; seed 003).

One trace per run: 4 optimizer steps of 3 micro-batches with an evaluation after step 2 (train-eval-train),
on the real `Trainer`. Recorded: after every micro-batch, the LM and aux losses and every expert and router
`main_grad`; after every step, the params, the fp32 masters and Adam moments, the published quantized
weights (rowwise and columnwise bytes and scales: the fp8 weight caches) and the eval loss. The graph run
(step 1 eager, steps 2-4 replayed) must equal the eager run bit for bit, with bf16, fp8 tensorwise and fp8
param gather in both expert layouts, bf16 and fp8 dropless experts in both layouts, fp8 delayed, rowwise and
blockwise scaling, `fp8: hybrid`, MXFP8 (with param gather, and on the grouped backend), NVFP4 and Muon.
The emulated GEMMs among them (Hopper has no MXFP8/NVFP4/blockwise GEMMs) split their token groups by the
dispatcher's equal drop-and-pad rows, known on the host, so nothing is read from the device in the capture.
`train.deterministic` makes the eager step itself bit-reproducible (index backward uses atomics
otherwise); the comparison is graph against eager, both deterministic.

The mutant test shows the equality has teeth: it refreshes the pinned weights only when the graph is first
captured (a Python decision taken at capture, which is what TE issue 3051 did with its weight cache), and
the traces must then differ from the first replayed step on.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from moectl.core.config.load import load_config
from trainer.distributed.quantized_storage import quantized_storage_of
from trainer.graphs import StaticWeights
from trainer.loop import Trainer
from trainer.observer import SilentObserver

pytestmark = pytest.mark.gpu

STEPS, EVAL_AFTER, MICRO = 4, 2, 3  # MICRO: micro-batches per step on each rank
BASE = [
    "model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
    "model.seq_length=64", "model.vocab_size=256", "moe.num_experts=4", "moe.router_topk=2",
    "moe.ffn_hidden_size=128", "moe.capacity_factor=1.25", "moe.pad_expert_input_to_capacity=true",
    "train.micro_batch_size=2", "train.global_batch_size=6", "train.eval_iters=2", "train.eval_interval=100",
    "train.deterministic=true", "train.device=cuda", "data.source=synthetic", "mixed_precision.bf16=true",
    "optimizer.lr=1e-3", "optimizer.lr_warmup_iters=0", f"train.train_iters={STEPS}", "logging.jsonl=false",
]
FP8 = ["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=tensorwise"]
DROPLESS = ["moe.capacity_factor=null", "moe.pad_expert_input_to_capacity=false"]  # T*K rows: static in bf16
EAGER = "train.cuda_graph=false"  # BASE is drop-and-pad, where the default (null) captures
VARIANTS = {
    "bf16": [],
    "bf16-per-expert": ["moe.single_grouped_weight=false"],
    "bf16-dropless": DROPLESS,
    "bf16-dropless-per-expert": [*DROPLESS, "moe.single_grouped_weight=false"],
    # expert biases: their grads are summed per expert from device counts (was MOE066: a host sync)
    "bf16-bias": ["moe.add_bias=true"],
    "bf16-dropless-bias-per-expert": [*DROPLESS, "moe.add_bias=true", "moe.single_grouped_weight=false"],
    "fp8": FP8,
    # dropless fp8: the input sized to its static bound, the slack padded into the last expert
    "fp8-dropless": [*FP8, *DROPLESS],
    "fp8-dropless-per-expert": [*FP8, *DROPLESS, "moe.single_grouped_weight=false"],
    "fp8-param-gather": [*FP8, "mixed_precision.fp8_param_gather=true"],
    "fp8-param-gather-per-expert": [*FP8, "mixed_precision.fp8_param_gather=true", "moe.single_grouped_weight=false"],
    # beyond what `train.cuda_graph: null` turns on (there only `true` captures them)
    "fp8-delayed": ["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=delayed"],
    # emulated on Hopper: captured since the dispatcher tells the experts their (equal) drop-and-pad rows
    "mxfp8": ["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=mxfp8"],
    "mxfp8-param-gather": ["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=mxfp8",
                           "mixed_precision.fp8_param_gather=true"],
    "mxfp8-grouped-backend": ["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=mxfp8", "moe.backend=grouped"],
    "fp8-rowwise": ["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=rowwise"],
    "fp8-blockwise": ["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=blockwise"],
    "fp8-hybrid": ["mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=tensorwise"],
    # its e5m2 backward in Triton reads device offsets: dropless captures too
    "fp8-hybrid-dropless": ["mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=tensorwise", *DROPLESS],
    "nvfp4": ["mixed_precision.fp4=e2m1"],
    "muon": ["optimizer.optimizer=muon"],
}


def _quantized(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        qt = getattr(m, "quantized_weight", None)
        if qt is None:
            continue
        for which in ("rowwise", "columnwise"):
            q = getattr(qt, which)
            if q is not None:
                for field, t in q.tensors().items():
                    out[f"{name}.{which}.{field}"] = t.detach().clone()
    return out


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Every tensor of every shard of the optimizer (or of each member of a Muon + AdamW chain): the fp32
    masters and the moments or momentum buffers."""
    out = []
    for member in getattr(optimizer, "members", [optimizer]):
        for shard in member.shards:
            out += [v.detach().clone() for v in vars(shard).values() if isinstance(v, torch.Tensor)]
    assert out, "no optimizer state found to compare"
    return out


def trace(overrides: list[str], run_dir: Path, runtime: Any = None, sync_each_step: bool = True) -> dict[str, Any]:
    """The run's per-micro-batch and per-step record (see the module docstring). `sync_each_step=False` leaves
    an overlapped param gather to the next step's first forward (inside its graph under data parallelism),
    so that gather has to be right for the next step to match; the snapshot then holds the staged params."""
    # A fresh Dynamo cache, as a `moectl train` process starts with: the compiled regions' code objects are
    # shared by every model of the process, and after other tests compiled them at other shapes (the tiny
    # config's Muon run of test_muon.py, say) Dynamo recompiled them with dynamic shapes and the capture,
    # under `eager_on_recompile`, ran some regions eagerly: graph != eager in every bf16 variant (H100,
    # fourteenth session). test_fast_step_gpu.py does the same.
    torch._dynamo.reset()
    cfg = load_config(None, [*BASE, *overrides, f"run_dir={run_dir}"])
    trainer = Trainer(cfg, SilentObserver(), runtime=runtime)
    watched = {n: p for n, p in trainer.model.named_parameters() if ".experts." in n or ".router." in n}
    micro: list[dict[str, torch.Tensor]] = []
    original = trainer.engine.micro_batch

    @contextmanager
    def recorded(is_last: bool) -> Iterator[None]:
        with original(is_last):
            yield
        micro.append({n: p.main_grad.detach().clone() for n, p in watched.items()})

    trainer.engine.micro_batch = recorded  # type: ignore[method-assign]
    steps: list[dict[str, Any]] = []
    for step in range(STEPS):
        record = trainer.train_step(step)
        # Finish the step's param gather first: a published per-tensor fp8 weight is a view of the gather
        # buffer, so an eager run's snapshot would otherwise catch the next gather landing, or not, by timing.
        if sync_each_step:
            trainer.engine.sync_params_for_eval()
        torch.cuda.synchronize()
        entry: dict[str, Any] = {
            "loss": record["loss"], "aux": record["aux_loss"], "grad_norm": record["grad_norm"],
            # quantized-storage params are placeholders (their values are the quantized bytes and the masters)
            "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()
                       if quantized_storage_of(p) is None},
            "quantized": _quantized(trainer.model),
            "optimizer": _optimizer_tensors(trainer.engine.optimizer),  # type: ignore[attr-defined]
        }  # fmt: skip
        if step + 1 == EVAL_AFTER:
            entry["eval"] = trainer.evaluate()
        steps.append(entry)
    graph = trainer.graph
    return {"micro": micro, "steps": steps, "replays": 0 if graph is None else graph.replays,
            "in_graph": (trainer.gathers_in_graph, trainer.engine.reduces_in_graph)}


def differences(a: dict[str, Any], b: dict[str, Any], reduced_in_place: bool = False,
                step_weights_one_side: bool = False) -> list[str]:
    """Where two traces differ (empty: bitwise equal). `reduced_in_place`: the last micro-batch of each step
    reduce-scatters into the grad buffer itself, launched inside its backward (overlap) and waited by the
    eager run only at the optimizer step, by the graph inside its replay: that micro-batch's snapshot is
    taken mid-reduction on one side, so it is not compared (the step's result is, through params, masters
    and moments). `step_weights_one_side`: a recipe under data parallelism quantizes its weights once per
    step only in the graph run (`Trainer.step_weights`; eagerly each forward quantizes, its gather
    overlapping the first), so a step after which one run holds no quantized weights at all is not a
    difference; where both hold them they are compared."""
    out = []
    for i, (x, y) in enumerate(zip(a["micro"], b["micro"])):
        if reduced_in_place and i % MICRO == MICRO - 1:
            continue
        out += [f"micro-batch {i}: {n}.main_grad" for n in x if not torch.equal(x[n], y[n])]
    for s, (x, y) in enumerate(zip(a["steps"], b["steps"])):
        out += [f"step {s + 1}: {k}" for k in ("loss", "aux", "grad_norm", "eval") if x.get(k) != y.get(k)]
        out += [f"step {s + 1}: param {n}" for n in x["params"] if not torch.equal(x["params"][n], y["params"][n])]
        pairs = enumerate(zip(x["optimizer"], y["optimizer"]))
        out += [f"step {s + 1}: optimizer shard tensor {i}" for i, (t, u) in pairs if not torch.equal(t, u)]
        if x["quantized"].keys() != y["quantized"].keys():
            if not (step_weights_one_side and not (x["quantized"] and y["quantized"])):
                out.append(f"step {s + 1}: quantized weights {sorted(x['quantized'])} vs {sorted(y['quantized'])}")
            continue
        out += [f"step {s + 1}: {n}" for n, t in x["quantized"].items() if not torch.equal(t, y["quantized"][n])]
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_graph_replay_equals_eager_bitwise(variant: str, tmp_path: Path) -> None:
    eager = trace([*VARIANTS[variant], EAGER], tmp_path / "eager")
    graph = trace([*VARIANTS[variant], "train.cuda_graph=true"], tmp_path / "graph")
    assert graph["replays"] == MICRO * (STEPS - 1) and eager["replays"] == 0
    assert len(eager["micro"]) == len(graph["micro"]) == MICRO * STEPS
    moved = [n for n, p in graph["steps"][-1]["params"].items() if not torch.equal(p, graph["steps"][0]["params"][n])]
    assert moved, "the params never changed: the comparison would prove nothing"
    if "param-gather" in variant:
        assert graph["steps"][-1]["quantized"], "fp8 param gather published no quantized weights"
    diff = differences(eager, graph)
    assert not diff, f"{len(diff)} differences, first: {diff[:6]}"


def test_a_capture_time_refresh_decision_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant: pinned weights refreshed only before the capture (a Python bool read once), so replays keep
    the capture step's fp8 weights. The bitwise comparison must see it."""
    variant = VARIANTS["fp8-param-gather"]
    eager = trace([*variant, EAGER], tmp_path / "eager")
    real = StaticWeights.refresh

    def refresh_at_capture_only(self: StaticWeights) -> int:
        if self.pinned:  # captured already: "not the first micro-batch", decided in Python
            return 0
        return real(self)

    monkeypatch.setattr(StaticWeights, "refresh", refresh_at_capture_only)
    mutant = trace([*variant, "train.cuda_graph=true"], tmp_path / "mutant")
    diff = differences(eager, mutant)
    assert diff, "a graph replaying stale fp8 weights went unnoticed"
    assert not any(d.startswith(("micro-batch 0:", "micro-batch 1:", "micro-batch 2:")) for d in diff), diff[:4]


TWO_GPU_CASES = {
    # bf16 params: the first micro-batch's graph holds the param gathers, the last one's the reduce-scatters
    "bf16": [],
    # a recipe quantizing weights once per step gathers before the step; its reductions are still captured
    "fp8": FP8,
    # layer-wise buffers (whole matrices per rank), gathered and reduced inside the graphs as Adam's
    "muon": ["optimizer.optimizer=muon"],
    "fp8-param-gather": [*FP8, "mixed_precision.fp8_param_gather=true"],
    # the all-to-all under drop-and-pad (BASE) is static: its collectives are captured with the micro-batch
    "ep2-alltoall": ["parallel.expert_model_parallel_size=2", "moe.token_dispatcher=alltoall"],
    # the overlapped exchange: async all-to-alls started and waited inside the captured micro-batch
    "ep2-alltoall-chunks2": ["parallel.expert_model_parallel_size=2", "moe.token_dispatcher=alltoall",
                             "moe.ep_overlap_chunks=2"],
}


def _two_gpu_body(rank: int, world_size: int, root: str, case: str) -> dict[str, Any]:
    dist.destroy_process_group()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{root}/nccl-rdzv", rank=rank, world_size=world_size)
    over = ["parallel.use_distributed_optimizer=true", "parallel.overlap_grad_reduce=true",
            "parallel.overlap_param_gather=true", "train.global_batch_size=12", *TWO_GPU_CASES[case]]  # fmt: skip
    # high-precision params: no per-step sync, so the next step's graph must gather them itself
    sync = case.startswith("fp8")
    eager = trace([*over, EAGER], Path(root) / f"eager-{rank}", sync_each_step=sync)
    graph = trace([*over, "train.cuda_graph=true"], Path(root) / f"graph-{rank}", sync_each_step=sync)
    diff = differences(eager, graph, reduced_in_place=True, step_weights_one_side=case == "fp8")
    return {"diff": diff[:6], "replays": graph["replays"],
            "compared": len(eager["micro"]) - STEPS, "in_graph": graph["in_graph"]}


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("case", list(TWO_GPU_CASES))
def test_graph_replay_equals_eager_on_two_gpus_with_overlap(case: str, tmp_path: Path) -> None:
    results = run_distributed(_two_gpu_body, world_size=2, timeout=400, root=str(tmp_path), case=case)
    # (param gathers, grad reductions) inside the graphs: quantized weights are gathered before the step
    in_graph = (False, True) if case.startswith("fp8") else (True, True)
    for rank, v in enumerate(results):
        assert v["replays"] == MICRO * (STEPS - 1) and v["compared"] == (MICRO - 1) * STEPS, (rank, case, v)
        assert v["in_graph"] == in_graph, (rank, case, v["in_graph"])
        assert not v["diff"], (rank, case, v["diff"])
