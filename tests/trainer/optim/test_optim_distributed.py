"""AdamW on flat shards vs torch.optim.AdamW, and DistributedOptimizer on one rank (no spawn).

Equality is bitwise (`torch.equal`) wherever the same formula runs in the same order: our unfused
update vs torch's single-tensor and foreach AdamW, our fused call vs torch's `fused=True`, and the whole
DistributedOptimizer vs torch's AdamW with clipping off. With clipping on, our global norm sums
per-bucket squares where torch takes a norm of per-param norms, so the clip factor may differ in the
last bit: checked to 1e-6 relative.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from dist_toy import ToyMoE, global_batch  # noqa: E402

from moectl.core.config.schema import OptimizerConfig, ParallelConfig  # noqa: E402
from trainer.distributed import DistributedModel, ParamSyncState  # noqa: E402
from trainer.parallel import ParallelState  # noqa: E402
from trainer.optim.adamw import adamw_update_, fused_adamw_update_  # noqa: E402
from trainer.optim.distributed_optimizer import DistributedOptimizer, decays  # noqa: E402
from trainer.optim.step_result import NonFiniteGradError  # noqa: E402

ONE = ParallelState.trivial()
CFG = OptimizerConfig(lr=0.02, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.0)


@pytest.mark.parametrize("mode", ["single", "foreach", "fused"])
def test_flat_adamw_is_bitwise_torch(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (13,), (3, 4, 6)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    params = [nn.Parameter(t.clone()) for t in init]
    kw = {"fused": True} if mode == "fused" else {"foreach": mode == "foreach"}
    ref = torch.optim.AdamW([{"params": [params[0], params[2]], "weight_decay": 0.1},
                             {"params": [params[1]], "weight_decay": 0.0}], lr=0.01, betas=(0.9, 0.95), **kw)
    flat = torch.cat([t.reshape(-1) for t in init])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    bounds = [(0, 35), (35, 48), (48, 120)]
    step_t = torch.zeros(())
    for step in range(1, 7):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        ref.step()
        gf = torch.cat([g.reshape(-1) for g in grads])
        hp = dict(lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8)
        if mode == "fused":
            step_t += 1
            views = lambda t, idx: [t[a:b] for i, (a, b) in enumerate(bounds) if i in idx]  # noqa: E731
            fused_adamw_update_(views(flat, {0, 2}), views(gf, {0, 2}), views(m, {0, 2}), views(v, {0, 2}),
                                step=step_t, weight_decay=0.1, **hp)
            fused_adamw_update_(views(flat, {1}), views(gf, {1}), views(m, {1}), views(v, {1}),
                                step=step_t, weight_decay=0.0, **hp)
        else:
            adamw_update_(flat, gf, m, v, step=step, weight_decay=0.1, decay_ranges=[bounds[0], bounds[2]], **hp)
        assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in params])), step


def test_weight_decay_rule() -> None:
    assert decays("inp.weight", nn.Parameter(torch.zeros(2, 2)))
    assert decays("experts.weight", nn.Parameter(torch.zeros(2, 2, 2)))
    assert not decays("inp.bias", nn.Parameter(torch.zeros(2)))
    assert not decays("norm.weight", nn.Parameter(torch.zeros(2)))
    assert not decays("experts.bias", nn.Parameter(torch.zeros(3, 2)))  # grouped bias: its per-expert twin is 1-D
    assert not decays("experts.bias0", nn.Parameter(torch.zeros(2)))


def torch_reference(model: nn.Module, cfg: OptimizerConfig, fused: bool = False) -> torch.optim.AdamW:
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if decays(n, p)], "weight_decay": cfg.weight_decay},
              {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
    kw = {"fused": True} if fused else {"foreach": False}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, **kw)


def loss_fn(model, step: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    x, y = global_batch(step, 6)
    return ((model(x) - y) ** 2).mean()


def run_pair(cfg: OptimizerConfig, pcfg: ParallelConfig, steps: int = 5, fused: bool = False):  # type: ignore[no-untyped-def]
    model = ToyMoE()
    ref = copy.deepcopy(model)
    dm = DistributedModel(model, pcfg, ONE)
    opt = DistributedOptimizer(dm, cfg, fused=fused)
    topt = torch_reference(ref, cfg, fused)
    norms = []
    for step in range(steps):
        dm.zero_grad_buffer()
        loss_fn(dm, step).backward()
        dm.finish_grad_sync()
        res = opt.step(cfg.lr)
        topt.zero_grad()
        loss_fn(ref, step).backward()
        max_norm = cfg.clip_grad if cfg.clip_grad > 0 else float("inf")
        tnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        topt.step()
        norms.append((res.grad_norm, float(tnorm)))
    return model, ref, opt, norms


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("bucket_size", [64, 10**6], ids=["tiny-buckets", "one-bucket"])
def test_distributed_optimizer_equals_torch_adamw_on_one_rank(fused: bool, bucket_size: int) -> None:
    model, ref, opt, norms = run_pair(CFG, ParallelConfig(bucket_size=bucket_size), fused=fused)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n
    for ours, theirs in norms:
        assert ours == pytest.approx(theirs, rel=1e-6)
    assert opt.gather_logical_state()["step"] == 5


def test_distributed_optimizer_with_clipping_tracks_torch() -> None:
    cfg = OptimizerConfig(lr=0.02, weight_decay=0.1, clip_grad=0.05)
    model, ref, _, norms = run_pair(cfg, ParallelConfig(bucket_size=100))
    assert all(ours > cfg.clip_grad for ours, _ in norms)  # clipping was active at every step
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)


def test_masters_and_moments_match_torch_state() -> None:
    _, _, opt, _ = run_pair(CFG, ParallelConfig(bucket_size=100), steps=3)
    state = opt.gather_logical_state()["params"]
    ref = ToyMoE()
    topt = torch_reference(ref, CFG)
    for step in range(3):
        topt.zero_grad()
        loss_fn(ref, step).backward()
        topt.step()
    for n, p in ref.named_parameters():
        assert torch.equal(state[n]["master"], p.detach()), n
        assert torch.equal(state[n]["exp_avg"], topt.state[p]["exp_avg"]), n
        assert torch.equal(state[n]["exp_avg_sq"], topt.state[p]["exp_avg_sq"]), n


def _inject_inf_and_step(dm: DistributedModel, opt: DistributedOptimizer, step: int) -> None:
    dm.zero_grad_buffer()
    loss_fn(dm, step).backward()
    dm.finish_grad_sync()
    dm.module.inp.weight.main_grad[0, 0] = float("inf")
    opt.step(CFG.lr)


def test_nonfinite_skip_leaves_everything_bit_unchanged_and_stop_raises() -> None:
    model = ToyMoE()
    dm = DistributedModel(model, ParallelConfig(bucket_size=100), ONE)
    opt = DistributedOptimizer(dm, CFG, on_nonfinite="skip")
    for step in range(2):
        dm.zero_grad_buffer()
        loss_fn(dm, step).backward()
        dm.finish_grad_sync()
        opt.step(CFG.lr)
    before_state = opt.gather_logical_state()
    before_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    dm.zero_grad_buffer()
    loss_fn(dm, 2).backward()
    dm.finish_grad_sync()
    model.inp.weight.main_grad[0, 0] = float("nan")
    grads_before = [b.grad_data.clone() for b in dm.buffers]
    res = opt.step(CFG.lr)
    assert res.skipped and opt.skipped_steps == 1 and opt.step_count == 2
    after = opt.gather_logical_state()
    assert after["step"] == before_state["step"]
    for n in before_params:
        assert torch.equal(model.get_parameter(n), before_params[n]), n
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(after["params"][n][k], before_state["params"][n][k]), (n, k)
    for b, g in zip(dm.buffers, grads_before):  # not even clipped
        assert torch.equal(b.grad_data.isnan(), g.isnan()) and torch.equal(b.grad_data.nan_to_num(), g.nan_to_num())
    # a finite step afterwards applies normally
    dm.zero_grad_buffer()
    loss_fn(dm, 3).backward()
    dm.finish_grad_sync()
    assert not opt.step(CFG.lr).skipped and opt.step_count == 3

    stop = DistributedOptimizer(DistributedModel(ToyMoE(), ParallelConfig(), ONE), CFG, on_nonfinite="stop")
    with pytest.raises(NonFiniteGradError, match="non-finite gradient") as err:
        _inject_inf_and_step(stop.dmodel, stop, 0)
    assert "on_nonfinite=skip" in err.value.one_line()
    assert stop.step_count == 0


def test_two_optimizers_sharing_buffers_equal_one() -> None:
    """Room for Muon + Adam: each optimizer owns its tag's buffers and gathers only its own groups."""
    tag = lambda n, p: "a" if n.startswith("experts") or n.startswith("out") else "b"  # noqa: E731
    pcfg = ParallelConfig(bucket_size=100, overlap_param_gather=True)
    split_model = ToyMoE()
    dm = DistributedModel(split_model, pcfg, ONE, optimizer_tags=tag)
    opt_a = DistributedOptimizer(dm, CFG, tag="a")
    opt_b = DistributedOptimizer(dm, CFG, tag="b")
    with pytest.raises(ValueError, match="already has an owner"):
        DistributedOptimizer(dm, CFG, tag="a")
    one_model = ToyMoE()
    dm1 = DistributedModel(one_model, pcfg, ONE)
    opt1 = DistributedOptimizer(dm1, CFG)
    for step in range(4):
        for d in (dm, dm1):
            d.zero_grad_buffer()
            loss_fn(d, step).backward()
            d.finish_grad_sync()
        opt_a.step(CFG.lr)
        staged = {g.tag for g in dm.bucket_groups if g.state is ParamSyncState.STAGED}
        assert staged == {"a"}  # b's groups untouched by a's step
        opt_b.step(CFG.lr)
        opt1.step(CFG.lr)
    dm.force_param_sync()
    dm1.force_param_sync()
    for (n, p), (_, q) in zip(split_model.named_parameters(), one_model.named_parameters()):
        assert torch.equal(p, q), n


def test_logical_state_round_trip_into_a_differently_bucketed_model() -> None:
    cfg = OptimizerConfig(lr=0.02, clip_grad=0.5)

    def steps(dm: DistributedModel, opt: DistributedOptimizer, rng: range) -> None:
        for step in rng:
            dm.zero_grad_buffer()
            loss_fn(dm, step).backward()
            dm.finish_grad_sync()
            opt.step(cfg.lr)

    a = ToyMoE()
    dm_a = DistributedModel(a, ParallelConfig(bucket_size=10**6), ONE)
    opt_a = DistributedOptimizer(dm_a, cfg)
    steps(dm_a, opt_a, range(3))
    saved = opt_a.gather_logical_state()
    steps(dm_a, opt_a, range(3, 6))

    b = ToyMoE(seed=123)  # different init: everything must come from the state
    dm_b = DistributedModel(b, ParallelConfig(bucket_size=64), ONE)
    opt_b = DistributedOptimizer(dm_b, cfg)
    opt_b.load_logical_state(saved)
    for n, p in b.named_parameters():
        assert torch.equal(p, saved["params"][n]["master"]), n
    steps(dm_b, opt_b, range(3, 6))
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)

    with pytest.raises(KeyError, match="lacks"):
        opt_b.load_logical_state({"params": {}})
    masters_only = {"params": {n: {"master": e["master"]} for n, e in saved["params"].items()}}
    c = ToyMoE(seed=7)
    opt_c = DistributedOptimizer(DistributedModel(c, ParallelConfig(), ONE), cfg)
    opt_c.load_logical_state(masters_only)
    got = opt_c.gather_logical_state()
    for n, e in saved["params"].items():
        assert torch.equal(got["params"][n]["master"], e["master"]) and not got["params"][n]["exp_avg"].any()
    assert got["step"] == 0


@pytest.mark.parametrize("n", [1, 255, 256, 1000, 2_000_003])
def test_sq_sum_is_accurate_at_any_length(n: int) -> None:
    from trainer.optim.grad_norm import sq_sum

    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * torch.rand(n, generator=torch.Generator()) ** 8
    exact = float(x.double().square().sum())
    assert float(sq_sum(x)) == pytest.approx(exact, rel=1e-6)  # one vector_norm call on the CPU: 1e-4 at 10M
