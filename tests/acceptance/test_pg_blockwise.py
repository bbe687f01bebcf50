"""Blockwise FP8 param gather (fp8 `blockwise` + `fp8_param_gather`) on 2 ranks: ON == OFF, bitwise.

Whole short trainings of the real GPT-MoE (pg_harness, hidden 128: 128x128 weight blocks), both expert
layouts, one spawn. OFF keeps bf16 weights (laid out in buffers as ON's) that every forward quantizes with
the recipe; ON keeps only FP8 bytes, each rank quantizing its master shard with block scales agreed by one
MAX all-reduce of block amaxes. Checked per layout:
- ON == OFF bitwise over train-eval-train (losses, the eval loss, masters, main grads, the weights every
  forward used), with the param gather synchronous and overlapped;
- train-eval-train == train (the eval's forced sync leaves nothing behind);
- the expert weights change every step (no frozen gather), and the quantized params are hash-identical
  across the two ranks;
- the block amax all-reduce is needed: some 128x128 block is touched by both ranks' shards (each rank alone
  saw a smaller amax than the agreed one for it);
- masters are the high-precision init values exactly.
GPU: the same body over NCCL on 2 GPUs, the same bitwise checks (deterministic kernels).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dist_helpers import run_distributed
from pg_harness import Knobs, build, differences, quantized_params, train, with_
from trainer.distributed import quantized_storage as qs
from trainer.parallel.groups import build_parallel_state

LAYOUTS = {"grouped": True, "per-expert": False}


def _spy_block_amaxes(seen: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Record (local, agreed) of every MAX all-reduce: the block amaxes before and after it."""
    real = qs.comm.all_reduce

    def spy(t: torch.Tensor, g: Any, **kw: Any) -> Any:
        if kw.get("op") != torch.distributed.ReduceOp.MAX:
            return real(t, g, **kw)
        local = t.detach().cpu().clone()
        out = real(t, g, **kw)
        seen.append((local, t.detach().cpu().clone()))
        return out

    qs.comm.all_reduce = spy  # this child only


def body(rank: int, world_size: int, backend: str = "gloo", root: str = "") -> dict[str, Any]:
    if backend == "nccl":  # as tests/acceptance/test_pg_dist.py: NCCL on this rank's GPU, deterministic kernels
        import os

        import torch.distributed as dist

        dist.destroy_process_group()
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{root}/nccl-rdzv", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    ps = build_parallel_state(1)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    _spy_block_amaxes(seen)
    out: dict[str, Any] = {"hashes": {}}
    for layout, grouped in LAYOUTS.items():
        base = Knobs(recipe="blockwise", grouped=grouped, steps=3)

        def run(k: Knobs) -> Any:
            r = train(k, ps)
            out["hashes"][f"{layout} {k.describe()} {k.eval_after}"] = r.hashes
            return r

        off = run(with_(base, gather=False, eval_after=(1,)))
        on = run(with_(base, eval_after=(1,)))
        on_overlap = run(with_(base, overlap=True, eval_after=(1,)))
        train_only = run(with_(base, overlap=True))
        out[f"{layout} on!=off"] = differences(on, off)
        out[f"{layout} overlap on!=off"] = differences(on_overlap, off)
        out[f"{layout} train-eval-train!=train"] = [d for d in differences(on_overlap, train_only) if "evals" not in d]
        out[f"{layout} evals"] = (on.evals, off.evals)
        h = on_overlap.history
        out[f"{layout} frozen steps"] = [i for i in range(1, len(h)) if torch.equal(h[i], h[i - 1])] + (
            [] if len(h) == 3 else [f"{len(h)} steps recorded"])
        ref, _, _ = build(with_(base, gather=False), ps)
        init = {n: p.detach().float().clone() for n, p in ref.named_parameters()}
        model, engine, _ = build(base, ps)
        masters = engine.optimizer.gather_logical_state()["params"]
        out[f"{layout} masters!=init"] = [n for n, e in masters.items() if not torch.equal(e["master"], init[n])]
        out[f"{layout} quantized"] = len(quantized_params(model))
    # blocks this rank saw only part of: its own amax below the agreed one (the other rank held the maximum)
    out["partial blocks"] = sum(int(((local < agreed) & (local > 0)).sum()) for local, agreed in seen)
    out["amax all-reduces"] = len(seen)
    return out


def check(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        for layout in LAYOUTS:
            where = f"rank {rank} {layout}"
            assert r[f"{layout} on!=off"] == [], f"{where}: blockwise param gather ON != OFF"
            assert r[f"{layout} overlap on!=off"] == [], f"{where}: overlapped blockwise param gather ON != OFF"
            assert r[f"{layout} train-eval-train!=train"] == [], f"{where}: an eval changed training"
            on_evals, off_evals = r[f"{layout} evals"]
            assert len(on_evals) == 1 and on_evals == off_evals, where
            assert r[f"{layout} frozen steps"] == [], f"{where}: frozen weights"
            assert r[f"{layout} masters!=init"] == [], where
            assert r[f"{layout} quantized"] == (8 if layout == "grouped" else 14), where
        assert all(v == [] for v in r["hashes"].values()), f"rank {rank}: replicas differ: {r['hashes']}"
        assert r["partial blocks"] > 0, f"rank {rank}: no block spans both ranks' shards; the test cannot tell"
        assert r["amax all-reduces"] > 0


@pytest.mark.slow
def test_blockwise_param_gather_on_two_ranks() -> None:
    check(run_distributed(body, world_size=2, timeout=300))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_blockwise_param_gather_on_two_gpus(tmp_path: Any) -> None:
    """NCCL (uint8 all-gather of the bytes, MAX all-reduce of the block amaxes), deterministic kernels, the
    same bitwise checks as on CPU: blockwise GEMMs are emulated in fp32 on every device."""
    results = run_distributed(body, world_size=2, timeout=600, backend="nccl", root=str(tmp_path))
    for r in results:
        print("GPU blockwise param gather:", {k: v for k, v in r.items() if k != "hashes"})
    check(results)
