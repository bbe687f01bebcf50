"""fp32 masters aliased on the param buffer, and the grad-norm verdict kept on the device (issue 5).

- fp32 params: each shard's master IS the param buffer's range (no write-back); bf16 params keep separate
  masters that staging writes back. Aliased and separate masters give bitwise equal training.
- Fused AdamW takes the clip as `grad_scale` and the non-finite verdict as `found_inf`, and the host
  reads (norm, found_inf) only after the update is queued: the same code runs on CPU (`fused=True`).
- A non-finite grad on one of 2 gloo ranks leaves params, moments and step count bit-unchanged everywhere.
- Checkpoint save/load of `.main_param` with fp32 params (masters = params) is exact.

Tolerance of the clipping comparison: torch's `clip_grad_norm_` multiplies grads by fp32(max_norm /
(norm + 1e-6)) while the fused kernel divides them by fp32((norm + 1e-6) / max_norm), and the norms are
summed differently (per-bucket fp64 vs torch's norm of per-param fp32 norms), so a clipped grad may differ
in its last bit or two. After 6 steps (3 of them clipped) params of magnitude ~0.3 differ by at most 9e-8
(3 ulp); checked at rtol=1e-6, atol=2e-7. A scale wrong by 0.1% gives 5e-5: 200x over.
Without active clipping (or with it off) the fused step is bitwise torch's `AdamW(fused=True)`.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer.observer import SilentObserver
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from dist_toy import ToyMoE, global_batch  # noqa: E402

from dist_helpers import run_distributed  # noqa: E402
from moectl.core.config.load import load_config  # noqa: E402
from moectl.core.config.schema import OptimizerConfig, ParallelConfig  # noqa: E402
from trainer.distributed import DistributedModel  # noqa: E402
from trainer.parallel import ParallelState  # noqa: E402
from trainer.distributed.param_storage import HighPrecisionStorage  # noqa: E402
from trainer.optim import distributed_optimizer as dopt  # noqa: E402
from trainer.optim.distributed_optimizer import DistributedOptimizer, decays  # noqa: E402
from trainer.optim.chained import ChainedOptimizer  # noqa: E402
from trainer.optim.grad_norm import GradVerdict, clip_coefficient, global_grad_verdict, local_sq_sum  # noqa: E402
from trainer.optim.layerwise import LayerWiseMuon  # noqa: E402
from trainer.optim.muon_routing import ADAM_TAG, MUON_TAG, muon_model_options  # noqa: E402
from trainer.optim.step_result import NonFiniteGradError  # noqa: E402

ONE = ParallelState.trivial()
CFG = OptimizerConfig(lr=0.02, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.0)


def loss_fn(model: nn.Module, step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x, y = global_batch(step, 6, dtype)
    return ((model(x) - y).float() ** 2).mean()


def one_step(dm: DistributedModel, opt: Any, step: int) -> Any:
    dm.zero_grad_buffer()
    loss_fn(dm, step, next(dm.module.parameters()).dtype).backward()
    dm.finish_grad_sync()
    return opt.step(opt.cfg.lr)


def _inside(t: torch.Tensor, buf: torch.Tensor) -> bool:
    start, end = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end


# --------------------------------------------------------------------------------------- aliased masters
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_fp32_masters_are_the_param_buffer_and_nothing_is_written_back(fused: bool, monkeypatch) -> None:
    stages: list[str] = []
    real_stage = HighPrecisionStorage.stage

    def stage(self: HighPrecisionStorage, bucket: Any, lo: int, hi: int, master: torch.Tensor) -> None:
        stages.append(bucket.buffer.key.describe())
        real_stage(self, bucket, lo, hi, master)

    monkeypatch.setattr(HighPrecisionStorage, "stage", stage)

    model = ToyMoE()
    dm = DistributedModel(model, ParallelConfig(bucket_size=100), ONE)
    opt = DistributedOptimizer(dm, CFG, fused=fused)
    assert len(opt.shards) > 2  # several buckets, params straddling them
    for s in opt.shards:
        assert s.aliased and s.master.dtype == torch.float32
        assert _inside(s.master, s.bucket.buffer.param_data)
        assert s.master.data_ptr() == s.bucket.param_data[s.lo:s.hi].data_ptr()
    for _ in range(3):
        one_step(dm, opt, _)
    assert stages == []  # no write-back: the update landed in the params
    state = opt.gather_logical_state()["params"]
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), state[n]["master"]), n

    # bf16 params keep separate fp32 masters, written back by staging
    model16 = ToyMoE(dtype=torch.bfloat16)
    dm16 = DistributedModel(model16, ParallelConfig(bucket_size=100), ONE)
    opt16 = DistributedOptimizer(dm16, CFG, fused=fused)
    for s in opt16.shards:
        assert not s.aliased and s.master.dtype == torch.float32
        assert not _inside(s.master, s.bucket.buffer.param_data)
    one_step(dm16, opt16, 0)
    assert len(stages) == len(opt16.shards)
    state16 = opt16.gather_logical_state()["params"]
    for n, p in model16.named_parameters():
        assert torch.equal(p.detach(), state16[n]["master"].bfloat16()), n


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_aliased_masters_train_bitwise_like_separate_ones(fused: bool) -> None:
    """Clipping active, overlap on (deferred gathers), several steps: every bit the same either way."""
    cfg = OptimizerConfig(lr=0.02, weight_decay=0.1, clip_grad=0.05)
    pcfg = ParallelConfig(bucket_size=64, overlap_param_gather=True)
    runs = []
    for alias in (True, False):
        model = ToyMoE()
        dm = DistributedModel(model, pcfg, ONE)
        opt = DistributedOptimizer(dm, cfg, fused=fused, alias_masters=alias)
        assert all(s.aliased == alias for s in opt.shards)
        norms = [one_step(dm, opt, step).grad_norm for step in range(5)]
        dm.force_param_sync()
        runs.append((norms, {n: p.detach().clone() for n, p in model.named_parameters()}, opt.gather_logical_state()))
    (na, pa, sa), (nb, pb, sb) = runs
    assert na == nb and all(n > cfg.clip_grad for n in na)
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa["params"][n][k], sb["params"][n][k]), (n, k)


def test_logical_state_load_writes_aliased_masters_and_params_together() -> None:
    a = ToyMoE()
    dm_a = DistributedModel(a, ParallelConfig(bucket_size=100), ONE)
    opt_a = DistributedOptimizer(dm_a, CFG)
    for step in range(2):
        one_step(dm_a, opt_a, step)
    saved = opt_a.gather_logical_state()
    b = ToyMoE(seed=5)
    dm_b = DistributedModel(b, ParallelConfig(bucket_size=64), ONE)
    opt_b = DistributedOptimizer(dm_b, CFG)
    opt_b.load_logical_state(saved)
    got = opt_b.gather_logical_state()
    for n, p in b.named_parameters():
        assert torch.equal(p.detach(), saved["params"][n]["master"]), n
        assert torch.equal(got["params"][n]["master"], saved["params"][n]["master"]), n
    # the gathered state is a copy: training on does not change what was saved
    before = {n: e["master"].clone() for n, e in got["params"].items()}
    one_step(dm_b, opt_b, 2)
    assert all(torch.equal(got["params"][n]["master"], before[n]) for n in before)


# --------------------------------------------------------------------------------------- device verdict
def torch_fused_reference(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if decays(n, p)], "weight_decay": cfg.weight_decay},
              {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             fused=True)


def run_against_torch_fused(cfg: OptimizerConfig, steps: int = 6) -> tuple[Any, ...]:
    model = ToyMoE()
    ref = copy.deepcopy(model)
    dm = DistributedModel(model, ParallelConfig(bucket_size=100), ONE)
    opt = DistributedOptimizer(dm, cfg, fused=True)
    topt = torch_fused_reference(ref, cfg)
    norms, grads_kept = [], []
    for step in range(steps):
        dm.zero_grad_buffer()
        loss_fn(dm, step).backward()
        dm.finish_grad_sync()
        before = [b.grad_data.clone() for b in dm.buffers]
        ours = opt.step(cfg.lr).grad_norm
        grads_kept.append(all(torch.equal(b.grad_data, g) for b, g in zip(dm.buffers, before)))
        topt.zero_grad()
        loss_fn(ref, step).backward()
        theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.clip_grad if cfg.clip_grad > 0 else float("inf"))
        topt.step()
        norms.append((ours, float(theirs)))
    return model, ref, opt, norms, grads_kept


@pytest.mark.parametrize("clip_grad", [0.0, 100.0], ids=["clip-off", "clip-inactive"])
def test_fused_step_without_active_clipping_is_bitwise_torch_fused(clip_grad: float) -> None:
    cfg = OptimizerConfig(lr=0.02, weight_decay=0.1, clip_grad=clip_grad)
    model, ref, opt, norms, grads_kept = run_against_torch_fused(cfg)
    assert all(ours < 100.0 for ours, _ in norms)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n
    for ours, theirs in norms:
        assert ours == pytest.approx(theirs, rel=1e-6)
    assert all(grads_kept)  # the launch without grad_scale ran: grads are not even rewritten
    assert opt.step_count == 6


def test_fused_clipping_by_grad_scale_tracks_torch_clip_grad_norm() -> None:
    # Norms run 2.6-6.0: clipped at some steps, not at others, so a wrong scale shows (Adam would forgive a
    # wrong factor applied at every step: it is nearly invariant to a constant scale of the grads).
    cfg = OptimizerConfig(lr=0.02, weight_decay=0.1, clip_grad=3.0)
    model, ref, opt, norms, grads_kept = run_against_torch_fused(cfg)
    clipped = [ours > cfg.clip_grad for ours, _ in norms]
    assert any(clipped) and not all(clipped)
    # the scaled launch ran exactly where clipping was needed (it stores the divided grads, as clip_grad_norm_
    # leaves them clipped); elsewhere the launch without grad_scale ran and the grads are untouched
    assert grads_kept == [not c for c in clipped]
    for ours, theirs in norms:
        assert ours == pytest.approx(theirs, rel=1e-6)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=2e-7, msg=n)


def test_grad_scale_is_the_reciprocal_clip_factor_and_nonfinite_is_found() -> None:
    sq = torch.tensor(4.0, dtype=torch.float64)  # norm 2
    v = global_grad_verdict(sq, ONE.dp)
    assert v.read() == (2.0, False) and v.found_inf.dtype == torch.float32 and float(v.found_inf) == 0.0
    assert v.grad_scale(0.0) is None
    assert float(v.grad_scale(10.0)) == 1.0  # under the threshold: divide by exactly 1
    assert float(v.grad_scale(0.5)) == pytest.approx((2.0 + 1e-6) / 0.5, rel=1e-7)
    for bad in (float("inf"), float("nan")):
        w = global_grad_verdict(torch.tensor(bad, dtype=torch.float64), ONE.dp)
        norm, found = w.read()
        assert found and float(w.found_inf) == 1.0 and (norm != norm or norm == float("inf"))


def test_clip_factor_is_the_host_clip_coefficient_on_the_device() -> None:
    """`GradVerdict.clip_factor` (Muon's device clip) gives, over norms of every size, the fp32 value a kernel
    receives for the host's `clip_coefficient` (so the device and host Muon steps share their bits); None
    when clipping is off; exactly 1 under the threshold."""
    gen = torch.Generator().manual_seed(11)
    norms = (torch.rand(20000, generator=gen, dtype=torch.float64) * 12 - 6).exp()
    for max_norm in (1.0, 3.0, 0.7):
        got = GradVerdict(norms, torch.zeros(())).clip_factor(max_norm)  # elementwise over a batch of norms
        want = torch.tensor([clip_coefficient(float(n), max_norm) for n in norms], dtype=torch.float64).float()
        assert got is not None and got.dtype == torch.float32 and torch.equal(got, want)
        assert bool((got == 1.0).any()) and bool((got < 1.0).any())
    v = GradVerdict(torch.tensor(0.5, dtype=torch.float64), torch.zeros(()))
    assert v.clip_factor(0.0) is None and float(v.clip_factor(10.0)) == 1.0  # type: ignore[arg-type]


def test_fused_update_is_queued_before_the_host_reads_the_verdict(monkeypatch) -> None:
    """The order a CUDA step issues work in: the update kernels go out before the only host read."""
    events: list[str] = []
    real_update, real_read = dopt.fused_adamw_update_, GradVerdict.read

    def update(*a: Any, **k: Any) -> None:
        assert k["found_inf"] is not None  # gated on the device verdict
        events.append("update")
        real_update(*a, **k)

    def read(self: GradVerdict) -> tuple[float, bool]:
        events.append("read")
        return real_read(self)

    monkeypatch.setattr(dopt, "fused_adamw_update_", update)
    monkeypatch.setattr(GradVerdict, "read", read)
    dm = DistributedModel(ToyMoE(), ParallelConfig(bucket_size=100), ONE)
    opt = DistributedOptimizer(dm, OptimizerConfig(lr=0.02, clip_grad=1.0), fused=True)
    one_step(dm, opt, 0)
    assert events[-1] == "read" and events.count("read") == 1
    assert events[:-1] == ["update"] * 4  # decayed + not, each unscaled and scaled (one of each pair runs)


def test_fused_skip_leaves_everything_bit_unchanged_and_stop_raises() -> None:
    for policy in ("skip", "stop"):
        model = ToyMoE()
        dm = DistributedModel(model, ParallelConfig(bucket_size=100), ONE)
        opt = DistributedOptimizer(dm, OptimizerConfig(lr=0.02, clip_grad=0.05), on_nonfinite=policy, fused=True)
        for step in range(2):
            one_step(dm, opt, step)
        state = opt.gather_logical_state()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        dm.zero_grad_buffer()
        loss_fn(dm, 2).backward()
        dm.finish_grad_sync()
        model.inp.weight.main_grad[0, 1] = float("inf")
        grads = [b.grad_data.clone() for b in dm.buffers]
        if policy == "stop":
            with pytest.raises(NonFiniteGradError, match="optimizer step 3"):
                opt.step(0.02)
        else:
            res = opt.step(0.02)
            assert res.skipped and res.grad_norm == float("inf")
        assert opt.step_count == 2 and opt.skipped_steps == 1
        after = opt.gather_logical_state()
        assert after["step"] == 2
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), params[n]), n
            for k in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(after["params"][n][k], state["params"][n][k]), (n, k)
        for b, g in zip(dm.buffers, grads):  # not even divided by a grad_scale
            assert torch.equal(b.grad_data, g)
        res = one_step(dm, opt, 3)
        assert not res.skipped and opt.step_count == 3


# --------------------------------------------------------------------------------------- Muon + AdamW chain
def _chain(alias: bool, on_nonfinite: str = "skip",
           muon_device: bool | None = None) -> tuple[ToyMoE, DistributedModel, ChainedOptimizer]:
    cfg = OptimizerConfig(lr=0.02, weight_decay=0.1, clip_grad=3.0, muon_momentum=0.9)
    model = ToyMoE()
    dm = DistributedModel(model, ParallelConfig(bucket_size=100), ONE, **muon_model_options(True))
    policy: Any = on_nonfinite
    members = [LayerWiseMuon(dm, cfg, tag=MUON_TAG, on_nonfinite=policy, alias_masters=alias,
                             device_verdict=muon_device),
               DistributedOptimizer(dm, cfg, tag=ADAM_TAG, on_nonfinite=policy, fused=True, alias_masters=alias)]
    return model, dm, ChainedOptimizer(dm, members)


def test_chain_of_muon_and_fused_adamw_shares_one_device_verdict() -> None:
    runs = []
    for alias in (True, False):
        model, dm, chain = _chain(alias)
        assert all(s.aliased == alias for m in chain.members for s in m.shards)  # type: ignore[attr-defined]
        norms = []
        for step in range(4):
            dm.zero_grad_buffer()
            loss_fn(dm, step).backward()
            dm.finish_grad_sync()
            norms.append(chain.step(0.02).grad_norm)
        runs.append((norms, {n: p.detach().clone() for n, p in model.named_parameters()}, chain.gather_logical_state()))
        if alias:  # a non-finite grad in the Adam member's buffers: the joint verdict skips both members
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            state = chain.gather_logical_state()
            dm.zero_grad_buffer()
            loss_fn(dm, 9).backward()
            dm.finish_grad_sync()
            model.norm.weight.main_grad[0] = float("nan")
            assert chain.step(0.02).skipped and chain.step_count == 4 and chain.skipped_steps == 1
            assert all(m.step_count == 4 for m in chain.members)
            after = chain.gather_logical_state()
            for n, p in model.named_parameters():
                assert torch.equal(p.detach(), before[n]), n
                for k, v in state["params"][n].items():
                    assert torch.equal(after["params"][n][k], v), (n, k)
    (na, pa, sa), (nb, pb, sb) = runs
    assert na == nb and any(n > 3.0 for n in na) and not all(n > 3.0 for n in na)
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
        for k, v in sa["params"][n].items():
            assert torch.equal(v, sb["params"][n][k]), (n, k)


def test_muon_with_the_verdict_on_the_device_steps_the_host_bits_and_queues_before_reading(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`LayerWiseMuon(device_verdict=True)` (CUDA's default; here forced on the CPU's torch path): the update is
    queued before the host reads the norm, the steps (clipped and not) give the host verdict's bits, and a
    non-finite Muon grad leaves every param, master, momentum and grad as it was, under skip and stop."""
    from trainer.optim import layerwise

    events: list[str] = []
    real_read, real_step = GradVerdict.read, layerwise.muon_step_

    def read(self: GradVerdict) -> tuple[float, bool]:
        events.append("read")
        return real_read(self)

    def step(*args: Any, **kwargs: Any) -> None:
        events.append("device" if kwargs.get("found_inf") is not None else "host")
        real_step(*args, **kwargs)

    monkeypatch.setattr(GradVerdict, "read", read)
    monkeypatch.setattr(layerwise, "muon_step_", step)
    runs = []
    for device in (False, True):
        model, dm, chain = _chain(True, muon_device=device)
        assert chain.members[0].device_verdict is device  # type: ignore[attr-defined]
        norms = []
        for i in range(4):
            events.clear()
            dm.zero_grad_buffer()
            loss_fn(dm, i).backward()
            dm.finish_grad_sync()
            norms.append(chain.step(0.02).grad_norm)
            assert events[:2] == (["device", "read"] if device else ["read", "host"]), events
        runs.append((norms, {n: p.detach().clone() for n, p in model.named_parameters()}, chain.gather_logical_state()))
    (na, pa, sa), (nb, pb, sb) = runs
    assert na == nb and any(n > 3.0 for n in na) and not all(n > 3.0 for n in na)  # clipped steps and others
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
        for k, v in sa["params"][n].items():
            assert torch.equal(v, sb["params"][n][k]), (n, k)
    for policy in ("skip", "stop"):
        model, dm, chain = _chain(False, on_nonfinite=policy, muon_device=True)
        dm.zero_grad_buffer()
        loss_fn(dm, 0).backward()
        dm.finish_grad_sync()
        chain.step(0.02)
        dm.zero_grad_buffer()
        loss_fn(dm, 1).backward()
        dm.finish_grad_sync()
        model.experts.weight.main_grad.view(-1)[5] = float("inf")  # a Muon matrix's grad
        before = ({n: p.detach().clone() for n, p in model.named_parameters()}, chain.gather_logical_state(),
                  [b.grad_data.clone() for b in dm.buffers])
        if policy == "skip":
            assert chain.step(0.02).skipped and chain.step_count == 1
        else:
            with pytest.raises(NonFiniteGradError):
                chain.step(0.02)
        after = chain.gather_logical_state()
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), before[0][n]), (policy, n)
            for k, v in before[1]["params"][n].items():
                assert torch.equal(after["params"][n][k], v), (policy, n, k)
        for b, g in zip(dm.buffers, before[2]):
            assert torch.equal(b.grad_data, g), policy  # not scaled in place either


# --------------------------------------------------------------------------------------- the norm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_norm_path_sums_squares_like_the_chunked_one(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    grads = [(torch.randn(n, generator=gen) * s).to(dtype) for n, s in ((1000, 1.0), (0, 1.0), (4097, 1e-3), (7, 30.0))]
    exact = sum(float(g.double().square().sum()) for g in grads)
    fast = local_sq_sum(grads, torch.device("cpu"), foreach=True)
    chunked = local_sq_sum(grads, torch.device("cpu"), foreach=False)
    assert fast.dtype == chunked.dtype == torch.float64
    assert float(fast) == pytest.approx(exact, rel=1e-6) and float(chunked) == pytest.approx(exact, rel=1e-6)
    assert float(local_sq_sum([], torch.device("cpu"), foreach=True)) == 0.0
    bad = [grads[0].clone(), grads[2]]
    bad[0][3] = float("nan")
    assert torch.isnan(local_sq_sum(bad, torch.device("cpu"), foreach=True))


# --------------------------------------------------------------------------------------- 2 gloo ranks
def _dp2_body(rank: int, world_size: int) -> dict[str, Any]:
    from dist_toy import Run, forward_backward

    from trainer.parallel.groups import build_parallel_state

    st = build_parallel_state(1)
    run = Run(clip_grad=0.05)
    out: dict[str, Any] = {}

    def build(alias: bool, policy: str = "skip") -> tuple[ToyMoE, DistributedModel, DistributedOptimizer]:
        model = ToyMoE()
        dm = DistributedModel(model, ParallelConfig(bucket_size=100), st)
        dm.broadcast_params()
        opt = DistributedOptimizer(dm, OptimizerConfig(lr=run.lr, clip_grad=run.clip_grad, weight_decay=0.1),
                                   on_nonfinite=policy, fused=True, alias_masters=alias)  # type: ignore[arg-type]
        return model, dm, opt

    def step(dm: DistributedModel, opt: DistributedOptimizer, i: int, inject: bool = False) -> Any:
        dm.zero_grad_buffer()
        forward_backward(dm, st, run, i)
        dm.finish_grad_sync()
        if inject:  # in this rank's own shard only: the other rank learns of it through the verdict alone
            bucket = dm.buffers[0].buckets[0]
            bucket.grad_data[bucket.shard_range()[0]] = float("inf")
        return opt.step(run.lr)

    # aliased masters at dp=2 (the gather rewrites each rank's own shard with the same values) == separate
    finals = {}
    for alias in (True, False):
        model, dm, opt = build(alias)
        assert all(s.aliased == alias for s in opt.shards)
        norms = [step(dm, opt, i).grad_norm for i in range(4)]
        dm.force_param_sync()
        finals[alias] = (norms, {n: p.detach().clone() for n, p in model.named_parameters()},
                         opt.gather_logical_state(), dm.check_param_hashes())
    a, b = finals[True], finals[False]
    out["alias_vs_separate"] = (a[0] == b[0], all(torch.equal(a[1][n], b[1][n]) for n in a[1]),
                                all(torch.equal(a[2]["params"][n][k], b[2]["params"][n][k])
                                    for n in a[2]["params"] for k in ("master", "exp_avg", "exp_avg_sq")),
                                a[3], b[3])

    # one rank's inf: both ranks skip (or stop) with params, m, v and step count bit-unchanged
    for policy in ("skip", "stop"):
        model, dm, opt = build(True, policy)
        step(dm, opt, 0)
        local = [(s.master.clone(), s.exp_avg.clone(), s.exp_avg_sq.clone()) for s in opt.shards]
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        buffers = [buf.param_data.clone() for buf in dm.buffers]
        try:
            outcome = "skipped" if step(dm, opt, 1, inject=rank == 1).skipped else "stepped"
        except NonFiniteGradError:
            outcome = "raised"
        dm.force_param_sync()
        unchanged = (
            all(torch.equal(s.master, m) and torch.equal(s.exp_avg, e) and torch.equal(s.exp_avg_sq, v)
                for s, (m, e, v) in zip(opt.shards, local))
            and all(torch.equal(p.detach(), params[n]) for n, p in model.named_parameters())
            and all(torch.equal(buf.param_data, x) for buf, x in zip(dm.buffers, buffers))
        )
        out[policy] = (outcome, unchanged, opt.step_count, opt.skipped_steps)
        if policy == "skip":
            after = step(dm, opt, 2)
            out["after_skip"] = (after.skipped, opt.step_count, dm.check_param_hashes())
    return out


@pytest.fixture(scope="module")
def dp2() -> list[dict[str, Any]]:
    return run_distributed(_dp2_body, world_size=2, timeout=120)


def test_dp2_aliased_masters_equal_separate_ones_bitwise(dp2: list[dict[str, Any]]) -> None:
    for r in dp2:
        assert r["alias_vs_separate"] == (True, True, True, [], [])


def test_dp2_one_ranks_inf_skips_on_both_ranks_with_state_bit_unchanged(dp2: list[dict[str, Any]]) -> None:
    assert [r["skip"] for r in dp2] == [("skipped", True, 1, 1)] * 2
    assert [r["after_skip"] for r in dp2] == [(False, 2, [])] * 2


def test_dp2_one_ranks_inf_stops_both_ranks_before_any_update(dp2: list[dict[str, Any]]) -> None:
    assert [r["stop"] for r in dp2] == [("raised", True, 1, 1)] * 2


# --------------------------------------------------------------------------------------- checkpoints
FAST = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=32", "moe.num_experts=4", "moe.ffn_hidden_size=16", "train.micro_batch_size=2",
    "train.global_batch_size=4", "data.source=synthetic", "train.eval_interval=null", "optimizer.lr_warmup_iters=1",
    "optimizer.lr_decay_iters=8", "logging.jsonl=false",
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_checkpoint_round_trip_of_aliased_fp32_masters_is_exact(tmp_path, monkeypatch, fused: bool,
                                                               device: str) -> None:
    """On the CPU (torch's AdamW kernels) and on CUDA (fused: the Triton AdamW writing the aliased params)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the device tool)")
    from ckpt import open_checkpoint
    from trainer.engine import distributed as dengine
    from trainer.loop import Trainer

    monkeypatch.setattr(dengine, "DistributedOptimizer",
                        lambda *a, **k: DistributedOptimizer(*a, **k, fused=fused))

    def trainer(*extra: str) -> Trainer:
        return Trainer(load_config(None, [*FAST, f"train.device={device}", f"run_dir={tmp_path}", *extra]),
                       SilentObserver())

    first = trainer("train.train_iters=3", "checkpoint.save_interval=3", "optimizer.clip_grad=0.01")
    first.run()
    opt = first.engine.optimizer
    assert opt.fused == fused and all(s.aliased for s in opt.shards)
    live = opt.gather_logical_state()
    ck = open_checkpoint(tmp_path / "checkpoints")
    for n, p in first.model.named_parameters():
        saved, param = ck.read(n + ".main_param"), p.detach().cpu()
        assert saved.dtype == torch.float32 and p.device.type == device
        assert torch.equal(saved, live["params"][n]["master"].cpu()) and torch.equal(saved, param), n
        assert torch.equal(ck.read(n), param), n  # model weight == master: the same memory was saved

    second = trainer("train.train_iters=3", f"checkpoint.load={tmp_path / 'checkpoints'}")
    opt2 = second.engine.optimizer
    assert all(s.aliased for s in opt2.shards)
    got = opt2.gather_logical_state()
    assert got["step"] == live["step"] == 3
    for n, p in second.model.named_parameters():
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got["params"][n][k].cpu(), live["params"][n][k].cpu()), (n, k)
        assert torch.equal(p.detach().cpu(), live["params"][n]["master"].cpu()), n
