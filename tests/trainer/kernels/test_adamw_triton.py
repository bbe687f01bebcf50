"""The Triton AdamW of `DistributedOptimizer` (trainer/kernels/adamw_triton.py) against torch's fused AdamW.

CPU: the per-chunk weight-decay flags (`chunk_decay_flags`): shared chunks refused, padding free, counted from
the bucket for dp shards that start mid-chunk, built by the optimizer where the kernel is wanted, and present
for the real model's layouts (so the kernel is what a GPU run takes). GPU (marked `gpu`): the kernel against
`torch._fused_adamw_` on flat tensors with decayed and undecayed chunks, clip scale and none, three steps:
within rtol 1e-6, atol 5e-7 (torch mixes doubles into its scalars, measured 6e-8 apart; a wrong bias
correction or decay errs by ~1e-4 or more),
`found_inf` leaves every bit as it was, and the published bf16 params are the masters cast; then a bf16 model
through `DistributedOptimizer` on the Triton path against the torch-kernel path (`MOECTL_TRITON_ADAMW=0`)
with clipping active at some steps, and its params equal to its masters cast with staging skipped; a skipped
step (non-finite grad) on the kernel leaves params and masters as they were and the next step publishes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from dist_toy import ToyMoE, global_batch  # noqa: E402

from moectl.core.config.load import load_config  # noqa: E402
from moectl.core.config.schema import OptimizerConfig, ParallelConfig  # noqa: E402
from trainer.distributed import DistributedModel  # noqa: E402
from trainer.distributed.layout import plan_buffer  # noqa: E402
from trainer.kernels import has_triton  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.observer import SilentObserver  # noqa: E402
from trainer.optim import distributed_optimizer as dopt  # noqa: E402
from trainer.optim.distributed_optimizer import DECAY_CHUNK, DistributedOptimizer, chunk_decay_flags, decays  # noqa: E402
from trainer.parallel import ParallelState  # noqa: E402

HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def test_chunk_flags_count_from_the_bucket_for_shards_that_start_mid_chunk() -> None:
    """dp=4 over a 5248-element bucket: shards of 1312 start 32 elements into a chunk on ranks 1 and 3. Counted
    from the shard, rank 3's first chunk would hold a decayed and an undecayed param; from the bucket (`shift`)
    every element's flag is its param's."""
    plan = plan_buffer([1000, 64, 4096, 64], 10**6, 4)
    bucket, decayed = plan.buckets[0], [True, False, True, False]
    size = plan.shard_size(bucket)
    for r in range(4):
        lo, hi = r * size, (r + 1) * size
        pieces = [(max(a, lo) - lo, min(b, hi) - lo, d) for (a, b), d in zip(plan.param_ranges, decayed)
                  if max(a, lo) < min(b, hi)]
        flags = chunk_decay_flags(pieces, size, 64, shift=lo % 64)
        assert flags is not None, r
        per_element = flags.repeat_interleave(64)[lo % 64:lo % 64 + size].bool()
        for a, b, d in pieces:
            assert bool(per_element[a:b].all()) if d else not bool(per_element[a:b].any())
    assert chunk_decay_flags([(0, 16, False), (32, 200, True)], 200, 64, shift=32) is not None
    assert chunk_decay_flags([(0, 40, False), (40, 200, True)], 200, 64, shift=32) is None


def test_chunk_flags_follow_the_params_and_refuse_shared_chunks() -> None:
    flags = chunk_decay_flags([(0, 100, True), (128, 130, False), (192, 300, True)], 320, 64)
    assert flags is not None and flags.tolist() == [1, 1, 0, 1, 1]  # chunk 1 = decayed tail + padding
    assert chunk_decay_flags([(0, 100, True), (100, 200, False)], 200, 64) is None  # a chunk of two params
    assert chunk_decay_flags([(0, 100, True), (100, 200, True)], 200, 64) is not None  # same flag: fine
    assert chunk_decay_flags([], 10, 64).tolist() == [0]  # only padding


@pytest.mark.parametrize("overrides", [[], ["mixed_precision.bf16=true", "moe.add_bias=true"],
                                       ["optimizer.optimizer=muon", "mixed_precision.bf16=true"]],
                         ids=["fp32", "bf16-bias", "muon-chain"])
def test_the_real_models_layouts_get_flags(overrides: list[str], tmp_path: Path) -> None:
    """Every AdamW shard of the real model's default layout (dp=1) gets flags, so a GPU run takes the kernel,
    and every element of a param carries its param's flag."""
    cfg = load_config(Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml",
                      [*overrides, f"run_dir={tmp_path}", "logging.jsonl=false"])
    opt = Trainer(cfg, SilentObserver()).engine.optimizer
    adam = [m for m in getattr(opt, "members", [opt]) if isinstance(m, DistributedOptimizer)]
    assert adam
    seen = set()
    for o in adam:
        for s in o.shards:
            names = s.bucket.buffer.names
            params = [(pc.bucket_lo - s.lo, pc.bucket_hi - s.lo, decays(names[pc.param], pc.param)) for pc in s.pieces]
            flags = chunk_decay_flags(params, s.hi - s.lo, DECAY_CHUNK)
            assert flags is not None
            got = flags.repeat_interleave(DECAY_CHUNK)[: s.hi - s.lo].bool()
            for a, b, d in params:
                assert bool(got[a:b].all()) if d else not bool(got[a:b].any())
                seen.add(d)
    assert seen == {True, False}  # decayed matrices and undecayed norms both checked


def test_optimizer_builds_the_flags_where_the_kernel_is_wanted(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_make_shard`'s own flags (as on a GPU): the optimizer takes the kernel, and every element of a param
    carries its param's flag; with the kernel not wanted, no flags and torch's kernel."""
    monkeypatch.setattr(dopt, "wants_triton_adamw", lambda device: True)
    dm = DistributedModel(ToyMoE(), ParallelConfig(bucket_size=300), ParallelState.trivial())
    opt = DistributedOptimizer(dm, OptimizerConfig(lr=0.02, weight_decay=0.1), fused=True)
    assert opt.triton
    for s in opt.shards:
        per_element = s.decay_flags.repeat_interleave(DECAY_CHUNK)[s.lo % DECAY_CHUNK:][: s.hi - s.lo].bool()
        for a, b, d in s.runs:
            if any(pc.bucket_lo - s.lo == a for pc in s.pieces):  # a param's run, not padding
                assert bool(per_element[a:b].all()) if d else not bool(per_element[a:b].any())
    assert {d for s in opt.shards for _, _, d in s.runs} == {True, False}
    monkeypatch.setattr(dopt, "wants_triton_adamw", lambda device: False)
    dm2 = DistributedModel(ToyMoE(), ParallelConfig(bucket_size=300), ParallelState.trivial())
    opt2 = DistributedOptimizer(dm2, OptimizerConfig(lr=0.02, weight_decay=0.1), fused=True)
    assert not opt2.triton and all(s.decay_flags is None for s in opt2.shards)


needs_kernels = pytest.mark.skipif(not (torch.cuda.is_available() and has_triton()), reason="needs CUDA and Triton")


def _state(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
    return [t.cuda() for t in (p, g, m, v)]


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("scale", [None, 2.5])
def test_kernel_tracks_torch_fused_adamw(scale: float | None) -> None:
    from trainer.kernels import adamw_triton

    n = 64 * 300 + 17  # a ragged last block and last chunk
    ours, ref_decay, ref_plain = _state(n, 0), _state(n, 0), None
    flags = (torch.arange(-(-n // 64), device="cuda") % 3 != 1).to(torch.uint8)  # mixed; the ragged last decayed
    decayed = flags.repeat_interleave(64)[:n].bool()
    ref_plain = [t.clone() for t in ref_decay]
    published = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    gs = None if scale is None else torch.tensor(scale, device="cuda")
    for step in (1, 2, 3):
        adamw_triton.adamw_(*ours, flags, 64, step=step, grad_scale=gs, found_inf=torch.zeros((), device="cuda"),
                            publish=published, **HP)
        for ref, wd in ((ref_decay, HP["weight_decay"]), (ref_plain, 0.0)):
            grads = [ref[1].clone()]  # torch's kernel stores the scaled grads back: keep the input grads
            torch._fused_adamw_([ref[0]], grads, [ref[2]], [ref[3]], [], [torch.tensor(float(step), device="cuda")],
                                amsgrad=False, lr=HP["lr"], beta1=HP["beta1"], beta2=HP["beta2"], weight_decay=wd,
                                eps=HP["eps"], maximize=False, grad_scale=gs, found_inf=None)
    for i in range(4):  # master, grad (untouched), exp_avg, exp_avg_sq
        want = torch.where(decayed, ref_decay[i], ref_plain[i])
        # atol: a few fp32 ulps of the inputs (randn, |p| < 5): a master that cancels to near 0 keeps the
        # absolute rounding of its terms (measured 6e-8 on an H100)
        torch.testing.assert_close(ours[i], want, rtol=1e-6, atol=5e-7)
    assert torch.equal(published, ours[0].bfloat16())


@pytest.mark.gpu
@needs_kernels
def test_found_inf_changes_nothing() -> None:
    from trainer.kernels import adamw_triton

    state, published = _state(5000, 1), torch.zeros(5000, dtype=torch.bfloat16, device="cuda")
    before = [t.clone() for t in state]
    flags = torch.ones(-(-5000 // 64), dtype=torch.uint8, device="cuda")
    adamw_triton.adamw_(*state, flags, 64, step=1, grad_scale=torch.tensor(3.0, device="cuda"),
                        found_inf=torch.ones((), device="cuda"), publish=published, **HP)
    assert all(torch.equal(a, b) for a, b in zip(state, before)) and not bool(published.any())


def _train(monkeypatch: pytest.MonkeyPatch, triton_on: bool) -> tuple[dict[str, torch.Tensor], DistributedOptimizer,
                                                                       list[float]]:  # fmt: skip
    monkeypatch.setenv(dopt.TRITON_ADAMW_ENV, "1" if triton_on else "0")
    model = ToyMoE(dtype=torch.bfloat16).cuda()
    dm = DistributedModel(model, ParallelConfig(bucket_size=300), ParallelState.trivial(torch.device("cuda")))
    opt = DistributedOptimizer(dm, OptimizerConfig(lr=0.02, weight_decay=0.1, clip_grad=3.0))
    norms = []
    for step in range(6):
        dm.zero_grad_buffer()
        x, y = global_batch(step, 6, torch.bfloat16)
        ((dm(x.cuda()) - y.cuda()).float() ** 2).mean().backward()
        dm.finish_grad_sync()
        norms.append(opt.step(0.02).grad_norm)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt, norms


@pytest.mark.gpu
@needs_kernels
def test_distributed_optimizer_on_the_kernel_tracks_the_torch_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    params, opt, norms = _train(monkeypatch, True)
    ref, ref_opt, ref_norms = _train(monkeypatch, False)
    assert opt.triton and not ref_opt.triton
    assert any(x > 3.0 for x in norms) and any(x < 3.0 for x in norms), norms  # clipped at some steps only
    assert all(s.published for s in opt.shards) and not any(s.published for s in ref_opt.shards)
    masters = {n: e["master"] for n, e in opt.gather_logical_state()["params"].items()}
    ref_masters = {n: e["master"] for n, e in ref_opt.gather_logical_state()["params"].items()}
    for n, p in params.items():
        assert torch.equal(p, masters[n].to(p.dtype)), n  # published without staging
        torch.testing.assert_close(masters[n], ref_masters[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.gpu
@needs_kernels
def test_a_skipped_step_on_the_kernel_changes_nothing_and_the_next_publishes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dopt.TRITON_ADAMW_ENV, "1")
    model = ToyMoE(dtype=torch.bfloat16).cuda()
    dm = DistributedModel(model, ParallelConfig(bucket_size=300), ParallelState.trivial(torch.device("cuda")))
    opt = DistributedOptimizer(dm, OptimizerConfig(lr=0.02, weight_decay=0.1, clip_grad=3.0), on_nonfinite="skip")
    assert opt.triton

    def grads(step: int, poison: bool = False) -> None:
        dm.zero_grad_buffer()
        x, y = global_batch(step, 6, torch.bfloat16)
        ((dm(x.cuda()) - y.cuda()).float() ** 2).mean().backward()
        dm.finish_grad_sync()
        if poison:
            dm.buffers[0].grad_data[0] = float("inf")

    grads(0)
    assert not opt.step(0.02).skipped
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters = [s.master.clone() for s in opt.shards]
    grads(1, poison=True)
    assert opt.step(0.02).skipped and opt.step_count == 1
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(torch.equal(s.master, m) for s, m in zip(opt.shards, masters))
    grads(2)
    assert not opt.step(0.02).skipped and opt.step_count == 2
    state = opt.gather_logical_state()["params"]
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert moved and all(torch.equal(p, state[n]["master"].to(p.dtype)) for n, p in model.named_parameters())
