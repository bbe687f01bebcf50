"""Layout, buffers, bucket groups and DistributedModel hooks, on one process (trivial ParallelState)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from dist_toy import Run, ToyMoE, forward_backward, make
from moectl.core.config.schema import ParallelConfig
from moectl.core.errors import ConfigError
from trainer.distributed import AliasedStagingStorage, DistributedModel, GradSyncError, ParamSyncError, ParamSyncState
from trainer.parallel import ParallelState
from trainer.distributed.bucket_group import BucketGroup, GradSyncState
from trainer.distributed.layout import PARAM_ALIGN, default_bucket_size, plan_buffer
from trainer.parallel.groups import check_ep_size, expert_seed, init_distributed
from trainer.main_grad import accumulate_wgrad

ONE = ParallelState.trivial()


# ------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("group_size", [1, 2, 3, 8])
@pytest.mark.parametrize("bucket_size", [1, 100, 1000, 10**9])
def test_plan_invariants(group_size: int, bucket_size: int) -> None:
    numels = [5, 300, 64, 1, 129, 2000, 7]
    plan = plan_buffer(numels, bucket_size, group_size)
    divisor = math.lcm(group_size, 128)
    prev_end = 0
    for (s, e), n in zip(plan.param_ranges, numels):
        assert s % PARAM_ALIGN == 0 and e - s == n and s >= prev_end
        prev_end = e
    assert plan.buckets[0].start == 0 and plan.buckets[-1].end == plan.total
    seen = []
    for b, nxt in zip(plan.buckets, plan.buckets[1:] + (None,)):
        assert b.numel % divisor == 0 and b.numel % group_size == 0
        if nxt is not None:
            assert nxt.start == b.end
        for i in b.param_indices:  # a param never straddles buckets
            s, e = plan.param_ranges[i]
            assert b.start <= s and e <= b.end
        seen.extend(b.param_indices)
        if nxt is not None:  # a bucket closes only once it is full
            last = plan.param_ranges[b.param_indices[-1]][1]
            assert last - b.start >= bucket_size
    assert seen == list(range(len(numels)))
    if bucket_size == 1:
        assert len(plan.buckets) == len(numels)
    if bucket_size == 10**9:
        assert len(plan.buckets) == 1


#: runs of per-expert params (named by the one tensor they stand for) between lone params; sizes off 64
RUN_NUMELS = [5, 100, 100, 100, 64, 7, 7, 7, 7, 300, 36, 36, 129]
RUN_NAMES = [None, "a", "a", "a", None, "b", "b", "b", "b", None, "c", "c", None]


@pytest.mark.parametrize("group_size", [1, 2, 3, 8])
@pytest.mark.parametrize("bucket_size", [1, 100, 250, 1000, 10**9])
def test_plan_lays_a_run_out_as_the_one_tensor_it_stands_for(group_size: int, bucket_size: int) -> None:
    """Each run gets exactly the plan of one param of its members' total size, cut into them back to back: its
    first member aligned, no padding inside, never split across buckets (small buckets would close inside it)."""
    plan = plan_buffer(RUN_NUMELS, bucket_size, group_size, RUN_NAMES)
    units: list[list[int]] = []
    for i, run in enumerate(RUN_NAMES):
        if run is not None and i and RUN_NAMES[i - 1] == run:
            units[-1].append(i)
        else:
            units.append([i])
    one = plan_buffer([sum(RUN_NUMELS[i] for i in u) for u in units], bucket_size, group_size)
    assert plan.total == one.total
    assert [(b.start, b.end) for b in plan.buckets] == [(b.start, b.end) for b in one.buckets]
    assert [b.param_indices for b in plan.buckets] == [tuple(i for k in b.param_indices for i in units[k])
                                                       for b in one.buckets]
    for unit, (start, end) in zip(units, one.param_ranges):
        assert start % PARAM_ALIGN == 0
        for i in unit:
            assert plan.param_ranges[i] == (start, start + RUN_NUMELS[i])
            start += RUN_NUMELS[i]
        assert start == end
    if bucket_size == 1:  # a bucket per run, and per lone param
        assert [len(b.param_indices) for b in plan.buckets] == [len(u) for u in units]
    assert plan_buffer(RUN_NUMELS, bucket_size, group_size, [None] * len(RUN_NUMELS)) == plan_buffer(
        RUN_NUMELS, bucket_size, group_size)  # no runs: the plan as before


def test_plan_refuses_runs_that_do_not_fit_the_params() -> None:
    with pytest.raises(ValueError, match="not consecutive"):
        plan_buffer([4, 4, 4], 100, 1, ["a", None, "a"])
    with pytest.raises(ValueError, match="3 run names for 2 params"):
        plan_buffer([4, 4], 100, 1, ["a", "a", None])
    plan = plan_buffer([4, 4, 4, 4], 100, 1, ["a", "a", "b", "b"])  # two runs back to back: the second aligned
    assert plan.param_ranges == ((0, 4), (4, 8), (64, 68), (68, 72))


def test_default_bucket_size() -> None:
    assert default_bucket_size(8) == 40_000_000
    assert default_bucket_size(64) == 64_000_000


# ------------------------------------------------------------------------------------------ buffers
def test_params_are_views_of_the_buffers_and_grads_reach_main_grad() -> None:
    model = ToyMoE()
    ref = copy.deepcopy(model)
    dm = DistributedModel(model, ParallelConfig(bucket_size=200), ONE)
    assert sorted(b.key.is_expert for b in dm.buffers) == [False, True]
    names = dict(model.named_parameters())
    order = [n for n, _ in reversed(list(model.named_parameters()))]
    for buf in dm.buffers:
        assert [buf.names[p] for p in buf.params] == [n for n in order if names[n] in buf.param_ranges]
        for p in buf.params:
            s, e = buf.param_ranges[p]
            # .data is a view of the param buffer, main_grad of the grad buffer (also for the 3-D expert weight)
            assert p.data_ptr() == buf.param_data[s:e].data_ptr() and p.shape == names[buf.names[p]].shape
            assert p.main_grad.data_ptr() == buf.grad_data[s:e].data_ptr() and p.main_grad.shape == p.shape
    for n, p in model.named_parameters():
        assert torch.equal(p, dict(ref.named_parameters())[n])  # binding kept the values

    # writing the buffer writes the param, including the [E, out, in] expert weight
    w = model.experts.weight
    assert w.dim() == 3
    buf = next(b for b in dm.buffers if b.key.is_expert)
    s, _ = buf.param_ranges[w]
    with torch.no_grad():
        buf.param_data[s] += 1.0
    assert w[0, 0, 0] == ref.experts.weight[0, 0, 0] + 1.0
    with torch.no_grad():
        buf.param_data[s] -= 1.0

    x = torch.randn(5, 8)
    dm.zero_grad_buffer()
    model(x).square().mean().backward()
    ref(x).square().mean().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is None, n  # folded into main_grad
        torch.testing.assert_close(p.main_grad, q.grad, rtol=0, atol=0, msg=n)


class _FusedMatmul(torch.autograd.Function):
    """A layer that accumulates its weight grad itself (gradient_accumulation_fusion) and returns None for it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.w = w
        return x @ w.t()

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        accumulate_wgrad(ctx.w, dy.t() @ x, fuse=True)
        return dy @ ctx.w, None


class _FusedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
        self.b = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedMatmul.apply(x, self.w) + self.b


def test_fused_wgrad_reports_exactly_once_and_launches_the_bucket() -> None:
    """The post-accumulate hook fires with .grad None for a fused param; it must not report again."""
    model = _FusedModel()
    dm = DistributedModel(model, ParallelConfig(overlap_grad_reduce=True), ONE)
    reported: list[str] = []
    group = dm.bucket_groups[0]
    original = group.grad_ready
    group.grad_ready = lambda p: (reported.append(dm.names[p]), original(p))  # type: ignore[method-assign]
    x = torch.randn(2, 3, requires_grad=True)
    dm.zero_grad_buffer()
    dm(x).sum().backward()
    assert sorted(reported) == ["b", "w"]
    assert group.grad_state.value == "launched"  # both reported: the reduce started during backward
    torch.testing.assert_close(model.w.main_grad, torch.ones(2, 4).t() @ x.detach())
    dm.finish_grad_sync()


def test_grad_after_launch_means_a_missing_no_sync() -> None:
    model = ToyMoE()
    dm = DistributedModel(model, ParallelConfig(overlap_grad_reduce=True), ONE)
    x = torch.randn(3, 8)
    dm.zero_grad_buffer()
    dm(x).sum().backward()  # last micro-batch: every group launches
    with pytest.raises(GradSyncError, match="no_sync"):
        dm(x).sum().backward()  # a second micro-batch not under no_sync()


def test_no_sync_accumulates_without_launching() -> None:
    model = ToyMoE()
    dm = DistributedModel(model, ParallelConfig(overlap_grad_reduce=True), ONE)
    x = torch.randn(3, 8)
    dm.zero_grad_buffer()
    with dm.no_sync():
        dm(x).sum().backward()
    assert all(g.grad_state.value == "accumulating" for g in dm.bucket_groups)
    dm(x).sum().backward()
    assert all(g.grad_state.value == "launched" for g in dm.bucket_groups)
    ref = copy.deepcopy(ToyMoE())
    (2 * ref(x).sum()).backward()
    torch.testing.assert_close(model.inp.weight.main_grad, ref.inp.weight.grad)
    dm.finish_grad_sync()


def test_a_replayed_reduce_is_recorded_only_with_nothing_in_flight() -> None:
    """`mark_grads_reduced` stands for a graph replay's reductions: it leaves every group reduced (so the
    optimizer may step), and refuses while a reduce launched by Python is still in flight."""
    _, dm, opt = make(ONE, ParallelConfig(), Run())
    dm.zero_grad_buffer()
    forward_backward(dm, ONE, Run(), 0)
    dm.mark_grads_reduced()
    assert dm.grads_reduced() and all(g.grad_state is GradSyncState.REDUCED for g in dm.bucket_groups)
    opt.step(0.1)
    g = dm.bucket_groups[0]
    g.reset_grad_sync()
    g._grad_handles.append(object())  # a reduce launched and not waited
    with pytest.raises(GradSyncError, match="in flight"):
        g.mark_reduced()


def test_a_replayed_gather_moves_staged_groups_to_post_processed() -> None:
    """`stage_for_graph_gather` + `mark_params_gathered` stand for a replay of a forward that gathers: every
    group staged before (a settled one re-staged), post-processed after; a settled group (the capture's own
    hooks ran) stays so; a gather in flight is refused."""
    _, dm, opt = make(ONE, ParallelConfig(overlap_param_gather=True), Run())
    dm.zero_grad_buffer()
    forward_backward(dm, ONE, Run(), 0)
    dm.finish_grad_sync()
    opt.step(0.1)  # overlap: staged, gathered by the next forward
    dm.force_param_sync()  # an eval in between settles them
    dm.stage_for_graph_gather()
    assert all(g.state is ParamSyncState.STAGED for g in dm.bucket_groups)
    dm.mark_params_gathered()
    assert all(g.state is ParamSyncState.POST_PROCESSED for g in dm.bucket_groups)
    dm.mark_params_gathered()  # after a capture, whose hooks settled them already
    assert all(g.state is ParamSyncState.POST_PROCESSED for g in dm.bucket_groups)
    g = dm.bucket_groups[0]
    g.stage()
    g.dispatch()
    g.sync.handles.append(object())  # dispatched by Python, not waited
    with pytest.raises(ParamSyncError, match="in flight"):
        g.mark_gathered()


def test_graph_collectives_need_data_parallel_data_to_move() -> None:
    """One rank reduces and gathers nothing, so no graph holds either (two ranks: test_graph_loop.py)."""
    _, dm, _ = make(ONE, ParallelConfig(overlap_param_gather=True), Run())
    assert not dm.reduces_grads and not dm.gathers_in_graph


def test_a_param_reporting_twice_is_an_error() -> None:
    model = ToyMoE()
    dm = DistributedModel(model, ParallelConfig(overlap_grad_reduce=True), ONE)
    g = dm.group_of(model.inp.weight)
    g.grad_ready(model.inp.weight)
    with pytest.raises(GradSyncError, match="twice"):
        g.grad_ready(model.inp.weight)


def test_step_before_finish_grad_sync_is_an_error() -> None:
    _, dm, opt = make(ONE, ParallelConfig(), Run())
    dm.zero_grad_buffer()
    forward_backward(dm, ONE, Run(), 0)
    with pytest.raises(GradSyncError, match="finish_grad_sync"):
        opt.step(0.1)


def test_bucket_group_refuses_mixed_optimizers() -> None:
    model = ToyMoE()
    dm = DistributedModel(model, ParallelConfig(), ONE,
                          optimizer_tags=lambda n, p: "muon" if p.dim() == 2 and "experts" not in n else "adam")
    dense = [b for b in dm.buffers if not b.key.is_expert]
    assert sorted(b.key.optimizer_tag for b in dense) == ["adam", "muon"]
    with pytest.raises(ValueError, match="mixes optimizers"):
        BucketGroup(99, [dense[0].buckets[0], dense[1].buckets[0]], True, 1.0)


def test_grad_reduce_in_bf16() -> None:
    model = ToyMoE(dtype=torch.bfloat16)
    dm = DistributedModel(model, ParallelConfig(grad_reduce_in_fp32=False), ONE)
    assert {b.grad_data.dtype for b in dm.buffers} == {torch.bfloat16}
    assert model.inp.weight.main_grad.dtype == torch.bfloat16
    dm32 = DistributedModel(ToyMoE(dtype=torch.bfloat16), ParallelConfig(grad_reduce_in_fp32=True), ONE)
    assert {b.grad_data.dtype for b in dm32.buffers} == {torch.float32}
    assert {b.param_data.dtype for b in dm32.buffers} == {torch.bfloat16}


# ------------------------------------------------------------------------------------------ aliased staging
def test_zeroing_an_aliased_staging_slice_leaves_the_rest_of_the_grad_memory() -> None:
    """fp32 grads, bf16 staging: post-processing zeroes only its bucket's staging slice."""
    model = ToyMoE(dtype=torch.bfloat16)
    dm = DistributedModel(model, ParallelConfig(bucket_size=100), ONE,
                          storage=lambda n, p: AliasedStagingStorage(torch.bfloat16))
    buf = next(b for b in dm.buffers if not b.key.is_expert)
    assert buf.param_data.dtype == torch.bfloat16 and buf.grad_data.dtype == torch.float32
    assert buf.param_data.untyped_storage().data_ptr() == buf.grad_data.untyped_storage().data_ptr()
    assert len(buf.buckets) >= 2
    bucket = buf.buckets[1]
    group = buf.bucket_groups[1]
    raw = buf.grad_data.view(torch.uint8)
    raw.fill_(0x3F)  # sentinel bytes everywhere in the grad memory
    group.stager = lambda g: None  # values are already "staged" (the sentinel)
    group.stage()
    group.gather()
    before = raw.clone()
    group.post_process()
    itemsize = 2
    lo, hi = bucket.start * itemsize, bucket.end * itemsize
    assert torch.all(raw[lo:hi] == 0)
    assert torch.equal(raw[:lo], before[:lo]) and torch.equal(raw[hi:], before[hi:])
    p = bucket.params[0]
    assert torch.all(p == torch.tensor([0x3F3F], dtype=torch.int16).view(torch.bfloat16))  # written into the param


def _step_once(dm: DistributedModel, opt, step: int, run: Run) -> None:
    dm.zero_grad_buffer()
    forward_backward(dm, ONE, run, step)
    dm.finish_grad_sync()
    opt.step(run.lr)


def test_zero_grad_buffer_restages_pending_aliased_groups() -> None:
    """Megatron #4987: with overlap_param_gather the deferred gather must not ship a zeroed staging buffer."""
    run = Run(steps=3)
    cfg = ParallelConfig(overlap_param_gather=True, overlap_grad_reduce=True)
    model, dm, opt = make(ONE, cfg, run, storage=lambda n, p: AliasedStagingStorage())
    ref_model, ref_dm, ref_opt = make(ONE, ParallelConfig(), run)
    for step in range(run.steps):
        _step_once(dm, opt, step, run)
        _step_once(ref_dm, ref_opt, step, run)
    assert all(g.state is ParamSyncState.STAGED for g in dm.bucket_groups)
    dm.zero_grad_buffer()
    for buf in dm.buffers:  # staged values survived the zero (re-staged), so they are the masters
        assert buf.param_data.abs().sum() > 0
    x = torch.randn(2, 8)
    with torch.no_grad():
        y = dm(x)  # pre-hooks gather and post-process
    assert all(g.state is ParamSyncState.POST_PROCESSED for g in dm.bucket_groups)
    assert all(torch.all(buf.grad_data == 0) for buf in dm.buffers)  # staging slices zeroed again
    torch.testing.assert_close(y, ref_model(x), rtol=0, atol=0)
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert torch.equal(p, q), n


def test_forced_sync_finalises_a_gather_in_flight() -> None:
    run = Run(steps=1)
    cfg = ParallelConfig(overlap_param_gather=True)
    model, dm, opt = make(ONE, cfg, run, storage=lambda n, p: AliasedStagingStorage())
    _step_once(dm, opt, 0, run)
    dm.zero_grad_buffer()
    g = dm.bucket_groups[0]
    g.dispatch()
    assert g.state is ParamSyncState.DISPATCHED
    with pytest.raises(ParamSyncError, match="destroy the values in flight"):
        dm.zero_grad_buffer()
    dm.force_param_sync()
    assert all(x.state is ParamSyncState.POST_PROCESSED for x in dm.bucket_groups)
    assert all(torch.all(buf.grad_data == 0) for buf in dm.buffers)
    masters = opt.gather_logical_state()["params"]
    for n, p in model.named_parameters():
        assert torch.equal(p, masters[n]["master"]), n


def test_stale_weights_are_detected_on_backward() -> None:
    """A param used without its module's __call__ would skip the pre-hook gather: refuse its grad."""
    run = Run(steps=1)
    model, dm, opt = make(ONE, ParallelConfig(overlap_param_gather=True), run)
    _step_once(dm, opt, 0, run)
    dm.zero_grad_buffer()
    y = torch.randn(2, 8) @ model.inp.weight.t()  # bypasses model.inp's pre-hook
    with pytest.raises(ParamSyncError, match="stale weights"):
        y.sum().backward()


# ------------------------------------------------------------------------------------------ parallel state
def test_trivial_state_and_ep_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    st = init_distributed(ParallelConfig())
    assert (st.world_size, st.rank, st.dp.size, st.ep.size, st.expert_dp.size) == (1, 0, 1, 1, 1)
    assert st.dp.pg is None and st.backend is None
    with pytest.raises(ConfigError, match="expert_model_parallel_size"):
        init_distributed(ParallelConfig(expert_model_parallel_size=2))
    check_ep_size(8, 4)
    with pytest.raises(ConfigError, match="divisor"):
        check_ep_size(6, 4)
    assert expert_seed(7, st) == expert_seed(7, ParallelState.trivial())


# ------------------------------------------------------------------------------------------ quantized-storage seam
def test_byte_storage_seam_masters_from_init_values_and_bytes_in_the_buffer() -> None:
    from dist_toy import ByteStorage

    init = ToyMoE()
    storage = ByteStorage()
    run = Run(steps=2)
    model, dm, opt = make(ONE, ParallelConfig(bucket_size=100, overlap_param_gather=True), run,
                          storage=lambda n, p: storage)
    assert {b.key.param_dtype for b in dm.buffers} == {torch.uint8}
    assert {b.param_data.dtype for b in dm.buffers} == {torch.uint8}
    assert storage.init_values == {}  # released on this rank once masters existed
    state = opt.gather_logical_state()["params"]
    for n, p in init.named_parameters():
        assert torch.equal(state[n]["master"], p.detach()), n  # exact init values, not dequantized bytes
        assert torch.equal(model.get_parameter(n), p.detach().to(torch.float8_e4m3fn).float()), n
    for step in range(run.steps):
        _step_once(dm, opt, step, run)
    dm.force_param_sync()
    masters = opt.gather_logical_state()["params"]
    for n, p in model.named_parameters():
        assert torch.equal(p, masters[n]["master"].to(torch.float8_e4m3fn).float()), n
        assert not torch.equal(masters[n]["master"], state[n]["master"]), n  # it trained


def test_overlap_refuses_a_param_without_grad_instead_of_reordering_collectives() -> None:
    model = ToyMoE()
    dm = DistributedModel(model, ParallelConfig(overlap_grad_reduce=True, bucket_size=100), ONE)
    dm.zero_grad_buffer()
    h = model.norm(torch.tanh(model.inp(torch.randn(2, 8))))
    model.out(h).sum().backward()  # the experts are not used: their params get no grad
    with pytest.raises(GradSyncError, match=r"experts\.bias"):
        dm.finish_grad_sync()
    plain = DistributedModel(ToyMoE(), ParallelConfig(bucket_size=100), ONE)  # without overlap: allowed
    plain.zero_grad_buffer()
    plain.module.out(torch.randn(2, 16)).sum().backward()
    plain.finish_grad_sync()
