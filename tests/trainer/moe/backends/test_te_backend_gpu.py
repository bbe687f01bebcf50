"""GPU: the `te` backend (Transformer Engine 2.20) against `fused` on the same weights and inputs (issue 16).

Marked `gpu` (skipped without CUDA) and skipped as a module where Transformer Engine does not import.
Everything on one GPU; run on a machine where scripts/gpu_te_setup.sh installed TE.

Tolerances (relative L2 error, ||got - ref|| / ||ref||; NaN never passes):
- bf16: te and fused each within 1e-2 of an fp32 per-expert autograd loop on the same bf16 values (the
  bound test_fused_gpu.py holds fused to), and te within 1e-2 of fused;
- fp8 tensorwise (e4m3, and hybrid's e5m2 grads): te within 5e-2 of fused under the same recipe, and no
  further from the bf16 result than fused is (x1.1 + 1e-3): both quantize the same tensors per expert with
  the same scale rule, and tiny upstream differences flip some fp8 roundings (most with e5m2);
- training: the same tiny config 6 steps with te and with fused: every loss within 2e-2 relative (bf16
  models drift apart slowly from different GEMM accumulation orders), and a checkpoint saved by either
  backend resumes under the other to the same next loss within the same bound.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cli_helpers import REPO, TINY, cli_env
from expert_oracle import oracle_grads, rel_err
from moectl.core.config.schema import MoEConfig
from trainer.main_grad import attach_main_grads
from trainer.moe.backends.fused import FusedBackend
from trainer.moe.expert_precision import ExpertPrecision
from trainer.moe.experts import GroupedMLP
from trainer.precision import TensorwiseRecipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="Transformer Engine not installed"),
]

ACTS = ["swiglu", "quick_geglu", "squared_relu"]
COUNTS = [128, 0, 77, 1, 300, 0, 33, 61]  # uneven, unaligned, two empty experts
D, F = 256, 384  # F divisible by 64 (TE reads that interleave natively) and by 8 (converted to halves)
NAMES = ("y", "dx", "dw1", "db1", "dw2", "db2", "dprobs")


@pytest.fixture(scope="module")
def te_backend():
    from trainer.moe.backends import get_backend

    return get_backend("te", "cuda")


def _problem(activation, counts, with_bias, with_probs, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    e, t = len(counts), sum(counts)
    h = F if activation == "squared_relu" else 2 * F

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    x, w1, w2 = randn(t, D), randn(e, h, D, scale=D**-0.5), randn(e, D, F, scale=F**-0.5)
    b1 = randn(e, h, scale=0.1) if with_bias else None
    b2 = randn(e, D, scale=0.1) if with_bias else None
    probs = torch.rand(t, device="cuda", generator=g) + 0.05 if with_probs else None
    return x, w1, b1, w2, b2, probs, randn(t, D)


def _spec(activation, interleave):
    return SimpleNamespace(activation=activation, glu_interleave_size=interleave, ffn_size=F)


def _run(backend, x, w1, b1, w2, b2, counts, probs, dy, spec, precision=None):
    kw = {} if precision is None else {"precision": precision}
    y, ctx = backend.forward(x, w1, b1, w2, b2, torch.tensor(counts, device="cuda"), probs, spec, **kw)
    return [y, *backend.backward(ctx, dy)]


def _finite(*tensors):
    for t in tensors:
        if t is not None:
            assert torch.isfinite(t).all(), "NaN or inf in a kernel output"


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("interleave", [None, 64, 8])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_probs", [True, False])
def test_te_bf16_matches_fused_and_the_loop(te_backend, activation, interleave, with_bias, with_probs):
    if interleave and activation == "squared_relu":
        pytest.skip("interleave applies to gated activations only")
    x, w1, b1, w2, b2, probs, dy = _problem(activation, COUNTS, with_bias, with_probs, seed=len(ACTS) + (interleave or 0))
    spec = _spec(activation, interleave)
    torch.full((64 << 20,), float("nan"), device="cuda")  # poison freed blocks: an unwritten row shows as NaN
    got = _run(te_backend, x, w1, b1, w2, b2, COUNTS, probs, dy, spec)
    fused = _run(FusedBackend("cuda"), x, w1, b1, w2, b2, COUNTS, probs, dy, spec)
    y_ref, grads_ref = oracle_grads(x, w1, b1, w2, b2, COUNTS, probs, dy, activation, interleave)
    ref = [y_ref, *grads_ref]
    _finite(*got)
    for name, a, b, r in zip(NAMES, got, fused, ref):
        if r is None:
            assert a is None, name
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, r) < 1e-2, (name, "te vs loop", rel_err(a, r))
        assert rel_err(a, b) < 1e-2, (name, "te vs fused", rel_err(a, b))
    for e, n in enumerate(COUNTS):
        if n == 0:  # an empty expert's weight grads are exactly zero
            assert not got[2][e].any() and not got[4][e].any()


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("interleave", [None, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_te_fp8_tensorwise_matches_fused(te_backend, fmt, interleave, with_bias):
    a = TensorwiseRecipe(fmt).align_size
    counts = [8 * a, 0, 3 * a, 17 * a, a]  # aligned (the dispatcher pads), uneven, one empty
    x, w1, b1, w2, b2, probs, dy = _problem("swiglu", counts, with_bias, True, seed=11)
    spec = _spec("swiglu", interleave)
    got = _run(te_backend, x, w1, b1, w2, b2, counts, probs, dy, spec, ExpertPrecision(TensorwiseRecipe(fmt)))
    fused = _run(FusedBackend("cuda"), x, w1, b1, w2, b2, counts, probs, dy, spec,
                 ExpertPrecision(TensorwiseRecipe(fmt)))  # fmt: skip
    hp = _run(FusedBackend("cuda"), x, w1, b1, w2, b2, counts, probs, dy, spec)
    _finite(*got)
    assert got[2].dtype == torch.float32 and got[4].dtype == torch.float32  # a recipe's weight grads
    for name, g, f, h in zip(NAMES, got, fused, hp):
        if h is None:
            assert g is None, name
            continue
        assert rel_err(g, f) < 5e-2, (name, "te vs fused fp8", rel_err(g, f))
        assert rel_err(g, h) <= 1.1 * rel_err(f, h) + 1e-3, (name, rel_err(g, h), rel_err(f, h))
        assert rel_err(g, h) < 0.1, (name, "te fp8 vs bf16", rel_err(g, h))
    assert not got[2][1].any() and not got[4][1].any()  # the empty expert


@pytest.mark.parametrize("grouped", [True, False], ids=["single_grouped", "per_expert"])
@pytest.mark.parametrize("fuse", [False, True], ids=["autograd", "main_grad"])
@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed_wgrad"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_te_through_grouped_mlp_both_layouts(grouped, fuse, delay, fp8):
    """GroupedMLP: te vs fused in both layouts, with fp32 main_grad accumulation and delayed wgrad."""
    out = {}
    counts = [32, 0, 48, 16]
    for backend in ("te", "fused"):
        cfg = MoEConfig(
            num_experts=4, ffn_hidden_size=128, backend=backend, glu_interleave_size=32, add_bias=True,
            single_grouped_weight=grouped, single_grouped_bias=grouped,
        )  # fmt: skip
        mlp = GroupedMLP(
            cfg, 64, params_dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0),
            gradient_accumulation_fusion=fuse, delay_wgrad=delay, recipe=TensorwiseRecipe() if fp8 else None,
        ).cuda()  # fmt: skip
        if fuse:
            attach_main_grads(mlp)
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(96, 64, device="cuda", generator=g).bfloat16().requires_grad_()
        probs = torch.rand(96, device="cuda", generator=g).requires_grad_()
        for _ in range(2):  # twice: main_grad accumulates
            y = mlp(x, torch.tensor(counts, device="cuda"), probs)
            y.backward(torch.randn(96, 64, device="cuda", generator=g).bfloat16())
            if delay:
                mlp.delayed.flush()
        grads = [p.main_grad if fuse else p.grad for p in mlp.parameters()]
        out[backend] = [y.detach(), x.grad, probs.grad, *grads]
    tol = 5e-2 if fp8 else 1e-2
    for i, (a, b) in enumerate(zip(out["te"], out["fused"])):
        _finite(a)
        assert rel_err(a, b) < tol, (i, rel_err(a, b))


# ---- training and checkpoints through the CLI ---------------------------------------------------------

TRAIN = [
    "train.train_iters=6", "train.eval_interval=null", "data.source=synthetic", "model.seq_length=64",
    "train.device=cuda", "mixed_precision.bf16=true", "checkpoint.save_interval=3",
    "moe.ffn_hidden_size=128", "model.hidden_size=128", "train.compile=none",
]  # fmt: skip


def _train(run_dir: Path, backend: str, *extra: str) -> dict[int, float]:
    sets = [f"moe.backend={backend}", *TRAIN, *extra]
    cmd = [sys.executable, "-m", "moectl", "train", TINY, "--run-dir", str(run_dir), "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    res = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_training_with_te_tracks_fused_and_checkpoints_cross_load(tmp_path: Path) -> None:
    te = _train(tmp_path / "te", "te")
    fused = _train(tmp_path / "fused", "fused")
    assert sorted(te) == sorted(fused) == list(range(1, 7))
    for step in te:
        assert abs(te[step] - fused[step]) <= 2e-2 * abs(fused[step]), (step, te[step], fused[step])
    # a checkpoint saved by one backend resumes under the other (same parameters, same names)
    for saver, loader, ref in (("te", "fused", fused), ("fused", "te", te)):
        step3 = tmp_path / saver / "checkpoints" / "step_00000003"
        assert step3.is_dir(), sorted(p.name for p in step3.parent.iterdir())
        resumed = _train(tmp_path / f"{saver}-to-{loader}", loader, f"checkpoint.load={step3}")
        assert sorted(resumed) == [4, 5, 6], resumed
        for step in resumed:
            assert abs(resumed[step] - ref[step]) <= 2e-2 * abs(ref[step]), (saver, loader, step)
