"""Layer-wise Muon on two gloo ranks, through the real loop (`Trainer`) on the real GPT-MoE.

One spawn, several short trainings at the same global batch (fp32): Muon at dp=1 (each rank alone, on a
one-rank runtime) is the reference. Checked on each rank:
- dp=2 (layer-wise: whole matrices per owner) equals dp=1 (losses and params, tight relative tolerance);
- overlapped grad reduce + param gather equals it bitwise; plain DDP (every rank steps every matrix)
  and ep=2 (expert owners within expert-dp) equal it within tolerance;
- params are hash-identical across replicas after every run;
- ownership is identical on every rank, every Muon matrix has exactly one owner, both ranks own some, and
  the grouped `[E, out, in]` expert weights are spread (each rank steps E/2 of their expert slices);
- a checkpoint save + resume in a fresh Trainer is bitwise (6 straight == 3 + save + 3: losses,
  params, masters, moments, momentum buffers);
- a sharded Muon buffer in the default layout (params straddling shards) is refused;
- the MXFP8 reuse-grad-buffer flow without the quantization (`AliasedStagingStorage(bf16)`: staging
  aliased on grad memory, gathered bf16, written into the params), on the toy model: overlapped reduce and
  deferred gather equal the synchronous run bitwise with an eval (forced sync) between steps, params are
  bf16(masters) on every rank and moved (a deferred gather of a zeroed staging buffer froze them in
  Megatron #4987);
- Muon with MXFP8 param gather on the reuse buffer (every rank quantizes the gathered bf16 masters), bf16
  params, through the Trainer: ON == OFF bitwise (losses, eval losses, masters), with overlapped reduce
  and deferred gather too, replicas' quantized bytes agree (Megatron #4987's acceptance test); the same
  on 2 GPUs over NCCL (GPU test), where Newton-Schulz runs in bf16.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from trainer.observer import SilentObserver
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from dist_helpers import run_distributed  # noqa: E402
from dist_toy import Run, ToyMoE, evaluate, forward_backward  # noqa: E402

from moectl.core.config.load import load_config  # noqa: E402
from moectl.core.config.schema import OptimizerConfig, ParallelConfig  # noqa: E402
from trainer.distributed import AliasedStagingStorage, DistributedModel  # noqa: E402
from trainer.parallel import ParallelState, build_parallel_state  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.optim.chained import build_muon_optimizer  # noqa: E402
from trainer.optim.layerwise import LayerWiseMuon  # noqa: E402
from trainer.optim.muon_routing import muon_model_options  # noqa: E402
from trainer.runtime import Runtime, setup_runtime  # noqa: E402

STEPS = 6
BASE = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=32", "model.vocab_size=256", "moe.num_experts=4", "moe.ffn_hidden_size=16",
    "moe.add_bias=true", "moe.single_grouped_bias=true", "train.micro_batch_size=2",
    "train.global_batch_size=8", "data.source=synthetic", "optimizer.lr_warmup_iters=0", "optimizer.lr=1e-3",
    f"optimizer.lr_decay_iters={STEPS}", "optimizer.optimizer=muon", "train.eval_interval=null",
    "logging.jsonl=false",
]
NO_OVERLAP = ["parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false"]  # null overlaps at dp 2
RUNS: dict[str, list[str]] = {
    "dp2": NO_OVERLAP,
    "overlap": ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"],
    "ddp": ["parallel.use_distributed_optimizer=false", *NO_OVERLAP],
    "ep2": ["parallel.expert_model_parallel_size=2", *NO_OVERLAP],
}


def _trainer(overrides: list[str], run_dir: Path, runtime: Runtime | None = None) -> Trainer:
    cfg = load_config(None, [*BASE, *overrides, f"run_dir={run_dir}"])
    return Trainer(cfg, SilentObserver(), runtime=runtime or setup_runtime(cfg.train, cfg.parallel))


def _train(overrides: list[str], run_dir: Path, runtime: Runtime | None = None) -> dict[str, Any]:
    trainer = _trainer([f"train.train_iters={STEPS}", *overrides], run_dir, runtime)
    losses = trainer.run().losses
    trainer.engine.sync_params_for_eval()
    muon = trainer.engine.optimizer.members[0]  # type: ignore[attr-defined]
    assert isinstance(muon, LayerWiseMuon)
    return {
        "losses": losses,
        "params": {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters()},
        "hash_mismatches": trainer.engine.dmodel.check_param_hashes(),  # type: ignore[attr-defined]
        "ownership": muon.ownership(),
        "owned": muon.owned(),
        "first_expert": getattr(trainer.model.moe_layers()[0].dispatcher, "first_expert", 0),
        "trainer": trainer,
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / (float(b.abs().max()) or 1.0)


def _compare(run: dict[str, Any], ref: dict[str, Any], first_expert: int = 0) -> tuple[float, float]:
    loss = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"]))
    params = 0.0
    for n, p in run["params"].items():
        q = ref["params"][n]
        q = q[first_expert:first_expert + p.shape[0]] if ".experts." in n else q
        params = max(params, _rel(p, q))
    return loss, params


def _resume(root: Path, straight: Trainer) -> dict[str, Any]:
    ckpts = root / "resume" / "checkpoints"
    _trainer([f"train.train_iters={STEPS // 2}", f"checkpoint.save_interval={STEPS // 2}"], root / "resume").run()
    second = _trainer([f"train.train_iters={STEPS}", f"checkpoint.load={ckpts}"], root / "resume")
    losses = second.run().losses
    a, b = straight.engine.optimizer.gather_logical_state(), second.engine.optimizer.gather_logical_state()
    same_state = a["step"] == b["step"] == STEPS and all(
        torch.equal(v, b["params"][n][k]) for n, e in a["params"].items() for k, v in e.items()
    )
    kinds = {k for e in a["params"].values() for k in e}
    same_params = all(torch.equal(p, q) for (_, p), (_, q) in zip(straight.model.named_parameters(),
                                                                   second.model.named_parameters()))
    return {"losses": losses, "state": same_state, "params": same_params, "kinds": sorted(kinds)}


def _refuses_default_layout(rank: int) -> str:
    model = nn.Sequential(nn.Linear(40, 25, bias=False))  # 1000 elements: the default plan splits them 2 ways
    pstate = build_parallel_state(1)
    dm = DistributedModel(model, ParallelConfig(use_distributed_optimizer=True), pstate,
                          optimizer_tags=lambda n, p: "muon")
    try:
        LayerWiseMuon(dm, OptimizerConfig(optimizer="muon"))
    except ValueError as e:
        return str(e)
    return "not refused"


def _toy_staged(pstate: ParallelState, overlap: bool) -> dict[str, Any]:
    pcfg = ParallelConfig(overlap_grad_reduce=overlap, overlap_param_gather=overlap, bucket_size=300)
    model = ToyMoE()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    dm = DistributedModel(model, pcfg, pstate, storage=lambda n, p: AliasedStagingStorage(torch.bfloat16),
                          **muon_model_options(True))
    dm.broadcast_params()
    run = Run(steps=4)
    opt = build_muon_optimizer(dm, OptimizerConfig(optimizer="muon", lr=run.lr, clip_grad=run.clip_grad,
                                                   weight_decay=0.1))
    losses = []
    for step in range(run.steps):
        dm.zero_grad_buffer()  # with overlap: wipes the staged values of the deferred gather; they are re-staged
        losses.append(forward_backward(dm, pstate, run, step))
        dm.finish_grad_sync()
        opt.step(run.lr)
        if step == 1:
            losses.append(evaluate(dm, run))  # a forced sync between steps, as eval does
    dm.force_param_sync()
    masters = {n: e["master"] for n, e in opt.gather_logical_state()["params"].items()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "params": params,
        "params_are_bf16_masters": all(torch.equal(p, masters[n].bfloat16().float()) for n, p in params.items()),
        "moved": min(float((p - init[n]).abs().max()) for n, p in params.items()),
        "hash_mismatches": dm.check_param_hashes(),
    }


MXFP8 = ["model.hidden_size=64", "moe.ffn_hidden_size=64", "mixed_precision.bf16=true", "mixed_precision.fp8=e4m3",
         "mixed_precision.fp8_recipe=mxfp8", "train.train_iters=4", "train.eval_interval=2",
         "train.eval_iters=1", "optimizer.lr=1e-2"]
GATHER = ["mixed_precision.fp8_param_gather=true", "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true"]
OVERLAP = ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"]


def _mxfp8_gather(root: Path, device: str = "cpu") -> dict[str, Any]:
    out = {}
    for name, extra in {"off": NO_OVERLAP, "on": [*GATHER, *NO_OVERLAP], "on_overlap": [*GATHER, *OVERLAP]}.items():
        t = _trainer([*MXFP8, *extra, f"train.device={device}"], root / f"mxfp8-{name}")
        result = t.run()
        t.engine.sync_params_for_eval()
        state = t.engine.optimizer.gather_logical_state()["params"]
        dmodel = t.engine.dmodel  # type: ignore[attr-defined]
        quantized = any("mxfp8" in b.key.storage for b in dmodel.buffers if b.key.optimizer_tag == "muon")
        out[name] = (result.losses, result.eval_losses, {n: e["master"] for n, e in state.items()},
                     dmodel.check_param_hashes(), quantized)
    off = out["off"]
    return {name: {"losses": r[0] == off[0], "evals": r[1] == off[1], "hashes": r[3], "quantized": r[4],
                   "masters": all(torch.equal(m, off[2][n]) for n, m in r[2].items())} for name, r in out.items()}


def muon_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    root_p = Path(root)
    one = Runtime(device=torch.device("cpu"), rank=0, world_size=1, local_rank=rank,
                  pstate=ParallelState.trivial(torch.device("cpu")))
    ref = _train([], root_p / f"dp1-rank{rank}", runtime=one)
    runs = {name: _train(o, root_p / name) for name, o in RUNS.items()}
    pstate = build_parallel_state(1)
    staged_sync, staged_overlap = _toy_staged(pstate, False), _toy_staged(pstate, True)
    dp2, over = runs["dp2"], runs["overlap"]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (dp2["ownership"], dp2["owned"], runs["ep2"]["ownership"]))
    init = _trainer([], root_p / "init", runtime=one).model  # the params before any step
    moved = max(_rel(dp2["params"][n], p.detach()) for n, p in init.named_parameters() if n in dp2["ownership"])
    return {
        "dp2_vs_dp1": _compare(dp2, ref),
        "ddp_vs_dp1": _compare(runs["ddp"], ref),
        "ep2_vs_ep1": _compare(runs["ep2"], dp2, runs["ep2"]["first_expert"]),
        "overlap_bitwise": over["losses"] == dp2["losses"]
        and all(torch.equal(p, dp2["params"][n]) for n, p in over["params"].items()),
        "hash_mismatches": {name: r["hash_mismatches"] for name, r in runs.items()},
        "everyone": everyone,
        "moved": moved,
        "resume": _resume(root_p, dp2["trainer"]),
        "straight_losses": dp2["losses"],
        "refusal": _refuses_default_layout(rank),
        "first_expert": runs["ep2"]["first_expert"],
        "staged": {
            "overlap_bitwise": staged_overlap["losses"] == staged_sync["losses"]
            and all(torch.equal(p, staged_sync["params"][n]) for n, p in staged_overlap["params"].items()),
            "bf16_masters": staged_sync["params_are_bf16_masters"] and staged_overlap["params_are_bf16_masters"],
            "moved": min(staged_sync["moved"], staged_overlap["moved"]),
            "hashes": staged_sync["hash_mismatches"] + staged_overlap["hash_mismatches"],
        },
        "mxfp8": _mxfp8_gather(root_p),
    }


@pytest.mark.slow
def test_layerwise_muon_dp2_equals_dp1_and_resumes_bitwise(tmp_path: Path) -> None:
    results = run_distributed(muon_body, world_size=2, timeout=240, root=str(tmp_path))
    for rank, r in enumerate(results):
        where = f"rank {rank}: " + str({k: v for k, v in r.items() if k != "everyone"})
        assert r["first_expert"] == 2 * rank, where  # ep=2 really split the experts
        assert max(r["dp2_vs_dp1"]) <= 1e-5, where
        assert max(r["ddp_vs_dp1"]) <= 1e-5, where
        assert max(r["ep2_vs_ep1"]) <= 1e-5, where
        assert r["overlap_bitwise"], where
        assert r["moved"] > 1e-3, where  # Muon moved the matrices (else equality proves nothing)
        assert all(v == [] for v in r["hash_mismatches"].values()), where
        assert r["resume"]["losses"] == r["straight_losses"][STEPS // 2:], where
        assert r["resume"]["state"] and r["resume"]["params"], where
        assert r["resume"]["kinds"] == ["exp_avg", "exp_avg_sq", "master", "momentum_buffer"], where
        assert "split across the shards" in r["refusal"], where
        st = r["staged"]
        assert st["overlap_bitwise"] and st["bf16_masters"] and st["moved"] > 1e-3 and st["hashes"] == [], where
        for name, mx in r["mxfp8"].items():  # "on" really gathers Muon's matrices as staged mxfp8
            want = {"losses": True, "evals": True, "masters": True, "hashes": [], "quantized": name != "off"}
            assert mx == want, (name, where)
    # Ownership: the same map on both ranks; every matrix (expert slices of a spread grouped weight count
    # one by one) stepped by exactly one rank, both ranks busy, and the grouped expert weights spread.
    (own0, owned0, ep_own0), (own1, owned1, ep_own1) = results[0]["everyone"]
    assert own0 == own1 and ep_own0 == ep_own1
    assert {r for ranks in own0.values() for r in ranks} == {0, 1}
    spread = {f"decoder.layers.{i}.mlp.experts.linear_fc{j}.weight" for i in range(2) for j in (1, 2)}
    assert {n for n, ranks in own0.items() if len(ranks) == 2} == spread  # [4, out, in]: 2 slices per rank
    steppers: dict[str, list[tuple[int, int]]] = {}
    for first, end, name in sorted((a, b, n) for n, a, b in owned0 + owned1):
        steppers.setdefault(name, []).append((first, end))
    for name, runs in steppers.items():  # the runs of slices tile the param: no gap, no overlap
        assert runs[0][0] == 0 and all(a[1] == b[0] for a, b in zip(runs, runs[1:])), (name, runs)
        assert runs[-1][1] == (4 if name in spread else 1) and len(runs) == len(own0[name]), (name, runs)
    assert set(steppers) == set(own0)
    assert [n for n, ranks in own0.items() if 1 in ranks] == [n for n, _, _ in owned1]
    # ep=2: expert matrices are owned within expert-dp (one rank: its own), dense ones over dp.
    assert all(ranks == (0,) for n, ranks in ep_own0.items() if ".experts." in n)
    assert {r for n, ranks in ep_own0.items() if ".experts." not in n for r in ranks} == {0, 1}


def mxfp8_gpu_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """`_mxfp8_gather` on this rank's GPU over NCCL (Newton-Schulz in bf16 there: `auto`)."""
    dist.destroy_process_group()  # run_distributed joined gloo; move to NCCL on this rank's GPU
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{root}/nccl-rdzv", rank=rank, world_size=world_size)
    return _mxfp8_gather(Path(root), device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_muon_mxfp8_param_gather_on_equals_off_on_two_gpus(tmp_path: Path) -> None:
    results = run_distributed(mxfp8_gpu_body, world_size=2, timeout=300, root=str(tmp_path))
    for rank, r in enumerate(results):
        for name, mx in r.items():
            want = {"losses": True, "evals": True, "masters": True, "hashes": [], "quantized": name != "off"}
            assert mx == want, (rank, name, mx)
