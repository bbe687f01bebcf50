"""Expert parallelism on two ranks: the ep=2 model is the ep=1 model, sharded.

Both models run on the same two ranks (dp = 2 either way, each rank its own tokens), so the only difference
is where the experts live: ep=1 has every expert on every rank, ep=2 half of them on each, with tokens
moved by the all-to-all (or all-gather) dispatcher. Checked, for both expert layouts and both dispatchers:
the init (bitwise: each rank's experts are its slice of the ep=1 init), logits and loss of step 0, every
reduced grad of step 0 (plain DDP), then losses, grad norms and every param after a few steps of the
distributed optimizer with overlapped grad reduce and param gather over two micro-batches. A layer-level
check routes every token to rank 0's experts, so rank 1 receives nothing (empty all-to-alls, empty
expert GEMMs, zero expert grads). CPU: gloo, fp32, 1e-5 relative (zero-initialised params: see CPU_TOL).
GPU (2 GPUs): NCCL, bf16 tolerances.

One spawn runs every case (a spawn costs seconds on the 2-core CI machine); the tests assert its results.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from moectl.core.config.schema import ModelConfig, MoEConfig, OptimizerConfig, ParallelConfig
from trainer.parallel import ParallelState
from trainer.engine.distributed import DistributedEngine
from trainer.parallel.groups import build_parallel_state
from trainer.model import GPTMoE
from trainer.moe import GroupedMLP, RouterOutput
from trainer.moe.expert_parallel import build_dispatcher, expert_shard

E, TOPK = 4, 2
CASES: dict[str, dict[str, Any]] = {
    "alltoall-grouped": dict(single_grouped_weight=True, single_grouped_bias=True),
    "alltoall-per-expert": dict(single_grouped_weight=False),
    "allgather-grouped": dict(single_grouped_weight=True, single_grouped_bias=True, token_dispatcher="allgather"),
    "allgather-per-expert-align4": dict(single_grouped_weight=False, token_dispatcher="allgather", align=4),
    "alltoall-capacity-align4": dict(capacity_factor=1.0, align=4),
    "alltoall-pad-to-capacity": dict(capacity_factor=1.25, pad_expert_input_to_capacity=True),
    # the overlapped exchange: the rows in chunks of capacity slots, each chunk's all-to-alls beside the
    # other chunks' expert MLP (C_pad = 20 rows per expert: chunks of 10; of 5, padded on arrival to 12)
    "alltoall-pad-chunks2": dict(capacity_factor=1.25, pad_expert_input_to_capacity=True, ep_overlap_chunks=2),
    "alltoall-pad-chunks4-per-expert-align4": dict(capacity_factor=1.25, pad_expert_input_to_capacity=True,
                                                   ep_overlap_chunks=4, single_grouped_weight=False, align=4),
}


@dataclasses.dataclass(frozen=True)
class Tol:
    """Largest relative differences allowed: max|a-b| / max|b| per tensor (out, grad, param), and
    ||a-b|| / ||b|| over all params together (param_norm)."""

    out: float
    grad: float
    param: float
    param_norm: float
    zero_init_param: float = float("inf")


# fp32: ep=1 and ep=2 compute the same sums in different orders - an expert's weight grad is one GEMM over
# both ranks' tokens under ep=2, a GEMM per rank plus an all-reduce under ep=1 - so grads differ by rounding
# (measured <= 3e-7 of each tensor's largest). Adam divides every element's grad by its own RMS, so in an
# element whose grad is k times below its tensor's largest that rounding becomes ~k * 3e-7 of a step.
# Params that start non-zero (weights, norms) are ~100x larger than 3 steps of lr 1e-4 and hide it: measured
# <= 7e-7 of their largest value. Zero-initialised params (biases) are nothing but their Adam steps, so they
# are compared in units of the distance training moved them (steps * lr): measured <= 1.6e-5 (experts that
# got few tokens, as when capacity drops some), across MKL's AVX-512, AVX2 (the path MKL takes on AMD CPUs)
# and SSE4.2 kernels, MKL_CBWR=COMPATIBLE, and ATen's AVX2/default kernels. An EP bug (a token at the wrong
# expert, a grad missing or doubled) moves an element by a whole step, 1.0 in these units.
CPU_TOL = Tol(1e-5, 1e-5, 1e-5, 1e-5, zero_init_param=2e-4)
# bf16: one-ulp differences of activations (4e-3) reach grads. After Adam steps, per-element comparisons mean
# nothing in bf16: elements whose grads are rounding noise get +-lr updates of random sign (zero-init biases
# differ by ~50% of their size). So params are compared as a whole: measured ~2e-4 (CPU bf16) against 2.4e-2
# for the updates themselves, so a missing or wrong update would show.
GPU_TOL = Tol(2e-2, 3e-2, float("inf"), 5e-3)


def rel_norm(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """||a - b|| / ||b|| over all pairs together."""
    num = sum(float((a.float() - b.float()).square().sum()) for a, b in pairs)
    den = sum(float(b.float().square().sum()) for _, b in pairs)
    return (num / den) ** 0.5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.float().abs().max()) if b.numel() else 0.0
    return float((a.float() - b.float()).abs().max()) / (scale or 1.0) if b.numel() else 0.0


def configs(case: dict[str, Any], bf16: bool = False) -> tuple[ModelConfig, MoEConfig, int]:
    case = dict(case)
    align = case.pop("align", 1)
    # In bf16 the second layer is dense: an expert output one bf16 ulp off (ep=2 runs each expert GEMM on
    # more rows, so cuBLAS may pick another kernel) could flip a near-tie top-k choice of a later router.
    mcfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, num_query_groups=1, seq_length=16,
                       vocab_size=64, moe_layer_freq=[1, 0] if bf16 else 1)
    moe = MoEConfig(num_experts=E, router_topk=TOPK, ffn_hidden_size=16, add_bias=True, z_loss_coeff=1e-3, **case)
    return mcfg, moe, align


def counterpart(name: str, p2: torch.Tensor, params1: dict[str, torch.Tensor], first: int) -> torch.Tensor:
    """The ep=1 tensor that param `name` of the ep=2 model must equal (its experts' slice, or itself)."""
    if ".experts." not in name:
        return params1[name]
    stem, leaf = name.rsplit(".", 1)
    if leaf in ("weight", "bias"):  # grouped [E, ...]
        return params1[name][first:first + p2.shape[0]]
    base = leaf.rstrip("0123456789")  # per-expert weight{i} / bias{i}: local i is global first + i
    return params1[f"{stem}.{base}{first + int(leaf[len(base):])}"]


def batch(step: int, micro: int, rank: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    tokens = torch.randint(0, vocab, (2, 17), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _ddp_step0(case: dict[str, Any], states: dict[int, ParallelState], rank: int, device: torch.device,
               dtype: torch.dtype) -> dict[str, float]:
    """Init, logits, loss and every reduced grad of one step (plain DDP, so each rank holds whole grads)."""
    mcfg, moe, align = configs(case, bf16=dtype == torch.bfloat16)
    ocfg = OptimizerConfig(lr=1e-3)
    models, engines, out = {}, {}, {}
    for ep in (1, 2):
        kw = {"ep_group": states[ep].ep} if ep > 1 else None
        models[ep] = GPTMoE(mcfg, moe, seed=7, params_dtype=dtype, expert_align=align, moe_layer_kwargs=kw).to(device)
    first = expert_shard(moe, states[2].ep)["first_expert"]
    p1 = dict(models[1].named_parameters())
    out["init_bitwise"] = all(torch.equal(p, counterpart(n, p, p1, first)) for n, p in models[2].named_parameters())
    tokens, targets = batch(0, 0, rank, mcfg.vocab_size, device)
    with torch.no_grad():
        out["logits"] = rel(models[2](tokens), models[1](tokens))
    losses = {}
    for ep in (1, 2):
        engines[ep] = DistributedEngine(models[ep], ParallelConfig(use_distributed_optimizer=False), ocfg, states[ep])
        engines[ep].zero_grad()
        with engines[ep].micro_batch(is_last=True):
            parts = models[ep].loss(tokens, targets)
            parts.total.backward()
        engines[ep].dmodel.finish_grad_sync()
        losses[ep] = parts.total.detach()
    out["loss"] = rel(losses[2], losses[1])
    g1 = {n: p.main_grad for n, p in models[1].named_parameters()}
    out["grad"] = max(rel(p.main_grad, counterpart(n, p, g1, first)) for n, p in models[2].named_parameters())
    out["dropped"] = float(sum(m.stats.num_dropped for m in models[2].moe_layers()))
    return out


def _train(case: dict[str, Any], states: dict[int, ParallelState], rank: int, device: torch.device,
           dtype: torch.dtype, steps: int = 3) -> dict[str, Any]:
    """A few steps of the distributed optimizer, overlap on, 2 micro-batches: losses, norms, params."""
    mcfg, moe, align = configs(case, bf16=dtype == torch.bfloat16)
    pcfg = ParallelConfig(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=3000)
    # fp32, lr 1e-4: Adam turns rounding-level grads (|g| ~ eps, where ep=1 and ep=2 sum in different orders)
    # into updates of up to ~lr/100 that differ; at 1e-3 that alone reached 1e-5 of a weight. bf16, lr 1e-3:
    # 3 steps must move weights by more than the 1e-2 tolerance could hide.
    ocfg = OptimizerConfig(lr=1e-4 if dtype == torch.float32 else 1e-3, weight_decay=0.1)
    res: dict[int, Any] = {}
    for ep in (1, 2):
        kw = {"ep_group": states[ep].ep} if ep > 1 else None
        model = GPTMoE(mcfg, moe, seed=7, params_dtype=dtype, expert_align=align, moe_layer_kwargs=kw).to(device)
        zero_init = {n for n, p in model.named_parameters() if not p.any()}  # ep=2's are ep=1's, sliced
        engine = DistributedEngine(model, pcfg, ocfg, states[ep])
        losses, norms = [], []
        for step in range(steps):
            engine.zero_grad()
            total = 0.0
            for micro in range(2):
                with engine.micro_batch(is_last=micro == 1):
                    loss = model.loss(*batch(step + 1, micro, rank, mcfg.vocab_size, device)).total / 2
                    loss.backward()
                total += float(loss.detach())
            losses.append(total)
            norms.append(engine.step(ocfg.lr).grad_norm)
        engine.sync_params_for_eval()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        res[ep] = (losses, norms, params, engine.dmodel.check_param_hashes(), zero_init)
    first = expert_shard(moe, states[2].ep)["first_expert"]
    l1, n1, p1, _, _ = res[1]
    l2, n2, p2, bad, zero_init = res[2]
    pairs = {n: (p, counterpart(n, p, p1, first)) for n, p in p2.items()}
    moved = steps * ocfg.lr  # how far Adam can move an element in `steps` steps, about
    return {
        "losses": max(abs(a - b) / abs(b) for a, b in zip(l2, l1)),
        "norms": max(abs(a - b) / abs(b) for a, b in zip(n2, n1)),
        "params": max(rel(a, b) for n, (a, b) in pairs.items() if n not in zero_init),
        "zero_init_params": max(float((a - b).abs().max()) / moved for n, (a, b) in pairs.items() if n in zero_init),
        "params_norm": rel_norm(list(pairs.values())),
        "hash_mismatches": bad,
    }


def _skewed_layer(states: dict[int, ParallelState], rank: int, device: torch.device, dtype: torch.dtype,
                  dispatcher: str) -> dict[str, float]:
    """Every token goes to experts 0 and 1 (rank 0's): rank 1 receives no rows at all."""
    moe = MoEConfig(num_experts=E, router_topk=TOPK, ffn_hidden_size=16, token_dispatcher=dispatcher)
    D, T = 8, 6
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, D, generator=g).to(device, dtype)
    probs = torch.rand(T, TOPK, generator=g).to(device)
    idx = torch.tensor([[0, 1], [1, 0]] * (T // 2), device=device)
    out: dict[str, float] = {}
    ys, grads = {}, {}
    for ep in (1, 2):
        group = states[ep].ep if ep > 1 else None
        mlp = GroupedMLP(moe, D, generator=torch.Generator().manual_seed(3), params_dtype=dtype,
                         **expert_shard(moe, group)).to(device)
        disp = build_dispatcher(moe, align=1, ep_group=group)
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        routed = RouterOutput(pi, idx, torch.bincount(idx.flatten(), minlength=E), torch.zeros(()), torch.zeros(()))
        x_PD, rows, probs_P, plan = disp.dispatch(xi, routed)
        if ep == 2:
            out["rows_received"] = float(x_PD.shape[0])
        y = disp.combine(mlp(x_PD, rows, probs_P), plan)
        y.float().square().sum().backward()
        ys[ep] = (y.detach(), xi.grad, pi.grad)
        w = mlp.linear_fc1.weight.grad
        if ep == 1:  # each rank's ep=1 grad covers its own tokens: sum them to get the owners' grads
            dist.all_reduce(w)
            w = w[expert_shard(moe, states[2].ep)["first_expert"]:][:E // 2]
        grads[ep] = w
    out["y"] = rel(ys[2][0], ys[1][0])
    out["dx"] = rel(ys[2][1], ys[1][1])
    out["dprobs"] = rel(ys[2][2], ys[1][2])
    out["dw1"] = rel(grads[2], grads[1])
    out["dw1_abs"] = float(grads[2].abs().max())
    return out


def _chunk_buffers_freed(states: dict[int, ParallelState], device: torch.device, dtype: torch.dtype) -> list[int]:
    """The chunked exchange's landing buffers alive (per checkpoint: after the forward, after the backward with
    the graph still referenced): autograd keeps a node's ctx until the graph dies, so a buffer held there
    would outlive its use by the whole step, for every layer. A finished transfer's work object may hold its
    rows a moment longer on the backend's own thread (gloo): each count waits up to 2 s for them to go."""
    import time
    import weakref

    from trainer.moe import MoELayer, dispatch_alltoall

    bufs: list[weakref.ref] = []

    class Watched(dispatch_alltoall.Landing):
        def block(self, index: int, like: torch.Tensor, rows: int) -> torch.Tensor:
            view = super().block(index, like, rows)
            if index == 0:
                bufs.append(weakref.ref(self.buf))
            return view

    moe = MoEConfig(num_experts=E, router_topk=TOPK, ffn_hidden_size=16, capacity_factor=1.25,
                    pad_expert_input_to_capacity=True, ep_overlap_chunks=2)  # fmt: skip
    layer = MoELayer(moe, 32, generator=torch.Generator().manual_seed(3), params_dtype=dtype,
                     ep_group=states[2].ep).to(device)  # fmt: skip
    original, dispatch_alltoall.Landing = dispatch_alltoall.Landing, Watched
    try:
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(4)).to(device, dtype).requires_grad_()
        def count() -> int:
            for _ in range(200):
                n = sum(r() is not None for r in bufs)
                if n == 0:
                    break
                time.sleep(0.01)
            return n

        loss = layer(x).float().square().sum()
        alive = [count()]
        loss.backward()
        alive.append(count())
    finally:
        dispatch_alltoall.Landing = original
    assert len(bufs) == 2, "the chunked path must have landed the outputs, then the grads"
    return alive


def ep_body(rank: int, world_size: int, backend: str = "gloo", root: str = "", bf16: bool = False) -> dict[str, Any]:
    device = torch.device("cpu")
    dtype = torch.bfloat16 if bf16 else torch.float32
    if backend == "nccl":  # run_distributed joined gloo; move to NCCL on this rank's GPU
        dist.destroy_process_group()
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{root}/nccl-rdzv", rank=rank, world_size=world_size)
        device = torch.device("cuda", rank)
    states = {1: build_parallel_state(1), 2: build_parallel_state(2)}
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        results[name] = {**_ddp_step0(case, states, rank, device, dtype), **_train(case, states, rank, device, dtype)}
    for disp in ("alltoall", "allgather"):
        results[f"skewed-{disp}"] = _skewed_layer(states, rank, device, dtype, disp)
    results["chunk-buffers-alive"] = _chunk_buffers_freed(states, device, dtype)
    return results


def check(results: list[dict[str, Any]], tol: Tol) -> None:
    for rank, res in enumerate(results):
        for name in CASES:
            r = res[name]
            where = f"rank {rank}, {name}: {r}"
            assert r["init_bitwise"], where
            assert r["logits"] <= tol.out and r["loss"] <= tol.out, where
            assert r["grad"] <= tol.grad, where
            assert r["losses"] <= tol.out and r["norms"] <= tol.grad, where
            assert r["params"] <= tol.param and r["params_norm"] <= tol.param_norm, where
            assert r["zero_init_params"] <= tol.zero_init_param, where
            assert r["hash_mismatches"] == [], where
        assert res["alltoall-capacity-align4"]["dropped"] > 0, "the capacity case must actually drop routings"
        assert res["chunk-buffers-alive"] == [0, 0], res["chunk-buffers-alive"]  # freed once used
        for disp in ("alltoall", "allgather"):
            r = res[f"skewed-{disp}"]
            where = f"rank {rank}, skewed {disp}: {r}"
            assert all(r[k] <= tol.grad for k in ("y", "dx", "dprobs", "dw1")), where
            if disp == "alltoall":
                assert (r["rows_received"] > 0) == (rank == 0), where
            assert (r["dw1_abs"] > 0) == (rank == 0), where  # rank 1's experts got no tokens: zero grads


@pytest.mark.slow
@pytest.mark.parametrize("mkl_instructions", [None, "AVX2"], ids=["mkl-native", "mkl-avx2"])
def test_ep2_equals_ep1_on_cpu(mkl_instructions: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also under MKL's AVX2 kernels, the path MKL takes on AMD CPUs: their GEMMs round differently, which
    is how this test once failed on an AVX-512 EPYC while passing on Intel machines."""
    if mkl_instructions:
        monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", mkl_instructions)  # the spawned ranks inherit it
    check(run_distributed(ep_body, world_size=2, timeout=180), CPU_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ep2_equals_ep1_on_two_gpus(tmp_path) -> None:
    results = run_distributed(ep_body, world_size=2, timeout=300, backend="nccl", root=str(tmp_path), bf16=True)
    print("ep2 vs ep1 on 2 GPUs, bf16:", results)
    check(results, GPU_TOL)


def _pad_recipe_body(rank: int, world_size: int) -> dict[str, Any]:
    import trainer.precision.gemm as gemm
    from trainer.moe import MoELayer
    from trainer.precision.recipes.mxfp8 import MXFP8Recipe

    state = build_parallel_state(2)
    calls = {"uniform": 0, "host": 0}
    real = gemm._segments

    def counted(q: Any) -> Any:
        calls["uniform" if q.groups.uniform is not None else "host"] += 1
        return real(q)

    gemm._segments = counted
    cfg = MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=64, capacity_factor=1.0,
                    pad_expert_input_to_capacity=True, token_dispatcher="alltoall")  # fmt: skip
    layer = MoELayer(cfg, 64, generator=torch.Generator().manual_seed(0), ep_group=state.ep, align=32,
                     recipe=MXFP8Recipe("e4m3"), params_dtype=torch.float32)  # fmt: skip
    # T = 24: capacity 12 per source, 24 rows per local expert, padded on arrival to mxfp8's 32
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    layer(x).sum().backward()
    calls["rows_each"] = layer.dispatcher.rows_per_expert(T=24, K=2)
    return calls


def test_ep_drop_and_pad_tells_the_experts_their_static_rows() -> None:
    """Under drop-and-pad each local expert gets C rows from each of the ep ranks: the dispatcher says so
    (`rows_per_expert`), so an emulated recipe's grouped GEMM splits its segments without reading offsets on
    the host - which a CUDA graph could not hold (MOE058 lets ep drop-and-pad capture)."""
    for rank, calls in enumerate(run_distributed(_pad_recipe_body, world_size=2, timeout=120)):
        assert calls["uniform"] > 0 and calls["host"] == 0 and calls["rows_each"] == 32, (rank, calls)


def _unequal_T_body(rank: int, world_size: int) -> str:
    from trainer.moe.dispatch_alltoall import AllToAllDispatcher

    state = build_parallel_state(2)
    disp = AllToAllDispatcher(4, state.ep, capacity_factor=1.0, pad_to_capacity=True)
    T = 12 if rank == 0 else 6
    idx = torch.stack([torch.randperm(4, generator=torch.Generator().manual_seed(t))[:2] for t in range(T)])
    routed = RouterOutput(torch.rand(T, 2), idx, torch.bincount(idx.flatten(), minlength=4), torch.zeros(()),
                          torch.zeros(()))  # fmt: skip
    try:
        disp.dispatch(torch.randn(T, 8), routed)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_ep_drop_and_pad_refuses_ranks_with_different_token_counts() -> None:
    """Static splits assume one T on every ep rank; another T would mismatch the all-to-all (a hang or
    garbage on NCCL). Both ranks say so instead."""
    for rank, msg in enumerate(run_distributed(_unequal_T_body, world_size=2, timeout=120)):
        assert "same micro-batch shape on every ep rank" in msg and "between 6 and 12" in msg, (rank, msg)
