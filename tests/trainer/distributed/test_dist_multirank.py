"""Two gloo ranks on the CPU: whole short trainings compared across configurations.

Spawns are expensive on a 2-core machine (~3 s each), so each spawned body runs many trainings and
returns plain numbers and flags; the test functions below assert them one by one (a module-scoped
fixture spawns once per body). Every comparison is made on both ranks.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch

from dist_helpers import run_distributed
from dist_toy import (
    ByteStorage,
    Run,
    ToyMoE,
    bitwise_equal,
    forward_backward,
    make,
    max_rel_diff,
    state_tensors,
    train,
)
from moectl.core.config.schema import OptimizerConfig, ParallelConfig
from trainer.distributed import AliasedStagingStorage, DistributedModel, ParamSyncState
from trainer.parallel import ParallelState
from trainer.distributed.bucket import Bucket
from trainer.parallel.comm import all_gather_object
from trainer.parallel.groups import build_parallel_state
from trainer.optim.distributed_optimizer import DistributedOptimizer
from trainer.optim.step_result import NonFiniteGradError

pytestmark = pytest.mark.slow

OVERLAP = dict(overlap_grad_reduce=True, overlap_param_gather=True)


class RecordingStaging(AliasedStagingStorage):
    """Aliased staging that counts post-processing per bucket (hook path vs forced path)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[tuple[bool, int]] = Counter()

    def post_gather(self, bucket: Bucket) -> None:
        self.calls[(bucket.buffer.key.is_expert, bucket.index)] += 1
        super().post_gather(bucket)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (bitwise_equal(a["params"], b["params"]) and a["norms"] == b["norms"]
            and bitwise_equal(state_tensors(a["state"]), state_tensors(b["state"])))


def _equivalence_body(rank: int, world_size: int) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    st = build_parallel_state(1)
    pc = lambda **kw: ParallelConfig(**{"bucket_size": 100, **kw})  # noqa: E731
    run = Run()
    out: dict[str, Any] = {}

    ref = train(ParallelState.trivial(), pc(), dataclasses.replace(run, n_micro=2 * run.n_micro))
    dp2 = train(st, pc(), run)
    out["dp2_vs_dp1"] = (max_rel_diff(dp2["params"], ref["params"]),
                         max_rel_diff(state_tensors(dp2["state"]), state_tensors(ref["state"])),
                         _rel(dp2["norms"], ref["norms"]))

    over = train(st, pc(**OVERLAP), run)
    plain = train(st, pc(use_distributed_optimizer=False), run)
    plain_over = train(st, pc(use_distributed_optimizer=False, **OVERLAP), run)
    out["overlap_bitwise"] = (_same_run(over, dp2), _same_run(plain_over, plain))
    out["plain_vs_distopt"] = (max_rel_diff(plain["params"], dp2["params"]),
                               max_rel_diff(state_tensors(plain["state"]), state_tensors(dp2["state"])),
                               _rel(plain["norms"], dp2["norms"]))

    noclip = dataclasses.replace(run, clip_grad=0.0)
    tiny, one = train(st, pc(bucket_size=1), noclip), train(st, pc(bucket_size=10**7), noclip)
    out["tiny_vs_one_bucket"] = (
        bitwise_equal(tiny["params"], one["params"])
        and bitwise_equal(state_tensors(tiny["state"]), state_tensors(one["state"])),
        # the reported norm adds fp32 per-bucket norms in another grouping: equal to fp32 rounding only
        _rel(tiny["norms"], one["norms"]),
        max_rel_diff(train(st, pc(bucket_size=1), run)["params"], train(st, pc(bucket_size=10**7), run)["params"]),
    )

    staged = train(st, pc(**OVERLAP), run, storage=lambda n, p: AliasedStagingStorage())
    out["aliased_staging_bitwise"] = _same_run(staged, over)
    tet = train(st, pc(**OVERLAP), dataclasses.replace(run, eval_after=(1,)),
                storage=lambda n, p: AliasedStagingStorage())
    out["train_eval_train_bitwise"] = _same_run(tet, staged) and len(tet["evals"]) == 1

    rec_hook, rec_forced = RecordingStaging(), RecordingStaging()
    hook = train(st, pc(**OVERLAP), run, storage=lambda n, p: rec_hook)
    forced = train(st, pc(**OVERLAP), dataclasses.replace(run, force_sync_before_forward=True),
                   storage=lambda n, p: rec_forced)
    out["forced_vs_hook"] = (_same_run(hook, forced), dict(rec_hook.calls), dict(rec_forced.calls))

    out["hash_mismatches"] = sorted({*dp2["hash_mismatches"], *over["hash_mismatches"], *plain["hash_mismatches"],
                                     *staged["hash_mismatches"]})
    model, dm, _ = make(st, pc(), run)
    if rank == 1:
        with torch.no_grad():
            model.out.bias[0] += 1e-6
    out["hash_negative"] = dm.check_param_hashes()

    byte_ref = train(ParallelState.trivial(), pc(**OVERLAP), dataclasses.replace(run, n_micro=2 * run.n_micro),
                     storage=lambda n, p, s=ByteStorage(): s)
    byte_dp2 = train(st, pc(**OVERLAP), run, storage=lambda n, p, s=ByteStorage(): s)
    out["byte_storage"] = (max_rel_diff(state_tensors(byte_dp2["state"]), state_tensors(byte_ref["state"])),
                           byte_dp2["hash_mismatches"])

    # broadcast_params: replicas built from different seeds end up with rank 0's values, bytes and init copies
    rank0 = dict(ToyMoE(seed=0).named_parameters())
    bcast = []
    for storage in (None, ByteStorage()):
        model = ToyMoE(seed=rank)
        dm = DistributedModel(model, pc(), st, storage=None if storage is None else (lambda n, p, s=storage: s))
        differ_before = dm.check_param_hashes()
        dm.broadcast_params()
        opt = DistributedOptimizer(dm, OptimizerConfig())
        masters = opt.gather_logical_state()["params"]
        bcast.append((len(differ_before), dm.check_param_hashes(),
                      all(torch.equal(masters[n]["master"], p.detach()) for n, p in rank0.items())))
    out["broadcast"] = bcast

    bf16 = dataclasses.replace(run, dtype=torch.bfloat16)
    ref16 = train(ParallelState.trivial(), pc(grad_reduce_in_fp32=False), dataclasses.replace(bf16, n_micro=4))
    dp16 = train(st, pc(grad_reduce_in_fp32=False, **OVERLAP), bf16)
    out["bf16_dp2_vs_dp1"] = max_rel_diff(dp16["params"], ref16["params"])
    # bf16 params, fp32 grads, bf16 staging in the first half of the grad memory (the MXFP8-reuse shape):
    # bucket k's staging overlaps other buckets' grads, yet the run is bitwise the params-in-buffer run
    hp16 = train(st, pc(**OVERLAP), dataclasses.replace(bf16, eval_after=(1,)))
    st16 = train(st, pc(**OVERLAP), dataclasses.replace(bf16, eval_after=(1,)),
                 storage=lambda n, p: AliasedStagingStorage(torch.bfloat16))
    out["bf16_staging_bitwise"] = _same_run(hp16, st16)
    return out


@pytest.fixture(scope="module")
def equivalence() -> list[dict[str, Any]]:
    return run_distributed(_equivalence_body, world_size=2, timeout=120)


def test_dp2_equals_dp1_at_the_same_global_batch(equivalence: list[dict[str, Any]]) -> None:
    for r in equivalence:
        params, masters, norms = r["dp2_vs_dp1"]
        assert params < 1e-5 and masters < 1e-5 and norms < 1e-5, r["dp2_vs_dp1"]


def test_overlap_on_equals_overlap_off_bitwise(equivalence: list[dict[str, Any]]) -> None:
    for r in equivalence:
        assert r["overlap_bitwise"] == (True, True)


def test_distributed_optimizer_equals_plain_ddp(equivalence: list[dict[str, Any]]) -> None:
    for r in equivalence:
        assert max(r["plain_vs_distopt"]) < 1e-6, r["plain_vs_distopt"]


def test_many_tiny_buckets_equal_one_bucket(equivalence: list[dict[str, Any]]) -> None:
    for r in equivalence:
        bitwise_without_clip, norm_rel, rel_with_clip = r["tiny_vs_one_bucket"]
        assert bitwise_without_clip and norm_rel < 1e-6 and rel_with_clip < 1e-6, r["tiny_vs_one_bucket"]


def test_aliased_staging_equals_params_in_the_buffer_bitwise(equivalence: list[dict[str, Any]]) -> None:
    for r in equivalence:
        assert r["aliased_staging_bitwise"]


def test_train_eval_train_equals_train_only(equivalence: list[dict[str, Any]]) -> None:
    for r in equivalence:
        assert r["train_eval_train_bitwise"]


def test_forced_sync_post_processes_exactly_like_the_hook_path(equivalence: list[dict[str, Any]]) -> None:
    for r in equivalence:
        same, hook_calls, forced_calls = r["forced_vs_hook"]
        assert same
        assert hook_calls == forced_calls and set(hook_calls.values()) == {Run().steps}  # once per bucket per step
        assert len(hook_calls) >= 3  # several buckets, so prefetching in the hooks was exercised


def test_params_hash_identical_across_replicas(equivalence: list[dict[str, Any]]) -> None:
    for r in equivalence:
        assert r["hash_mismatches"] == []
        assert r["hash_negative"] == ["out.bias"]  # and the check does catch a difference


def test_byte_storage_gathers_bytes_and_tracks_dp1(equivalence: list[dict[str, Any]]) -> None:
    """The quantized-storage seam over 2 ranks: uint8 buffers gathered, masters sharded and exact."""
    for r in equivalence:
        rel, mismatches = r["byte_storage"]
        assert rel < 1e-5 and mismatches == []


def test_bf16_staging_in_fp32_grad_memory_is_bitwise(equivalence: list[dict[str, Any]]) -> None:
    for r in equivalence:
        assert r["bf16_staging_bitwise"]


def test_broadcast_params_makes_replicas_agree(equivalence: list[dict[str, Any]]) -> None:
    for r in equivalence:
        assert r["broadcast"] == [(6, [], True), (6, [], True)]  # 6 of 8 differed (LayerNorm inits agree); none after


def test_bf16_params_with_bf16_grad_reduce_track_dp1(equivalence: list[dict[str, Any]]) -> None:
    for r in equivalence:
        assert r["bf16_dp2_vs_dp1"] < 2e-2


# ---------------------------------------------------------------------------------------------------
def _one_step(dm, st, run: Run, step: int, inject: bool = False):  # type: ignore[no-untyped-def]
    dm.zero_grad_buffer()
    forward_backward(dm, st, run, step)
    dm.finish_grad_sync()
    if inject:  # a non-finite value in this rank's own shard only: no other rank ever sees it
        bucket = dm.buffers[0].buckets[0]
        lo, _ = bucket.shard_range()
        bucket.grad_data[lo] = float("inf")


def _failure_and_ep_body(rank: int, world_size: int) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    st = build_parallel_state(1)
    out: dict[str, Any] = {}

    # one rank's non-finite grad: every rank stops, or every rank skips with state unchanged
    for policy in ("stop", "skip"):
        run = Run(on_nonfinite=policy)
        model, dm, opt = make(st, ParallelConfig(bucket_size=300), run)
        _one_step(dm, st, run, 0)
        opt.step(run.lr)
        before_state = state_tensors(opt.gather_logical_state())
        before_params = {n: p.detach().clone() for n, p in model.named_parameters()}
        _one_step(dm, st, run, 1, inject=rank == 1)
        try:
            outcome = "skipped" if opt.step(run.lr).skipped else "stepped"
        except NonFiniteGradError:
            outcome = "raised"
        unchanged = (bitwise_equal(state_tensors(opt.gather_logical_state()), before_state)
                     and bitwise_equal({n: p.detach() for n, p in model.named_parameters()}, before_params)
                     and opt.step_count == 1)
        out[policy] = (outcome, unchanged)
        if policy == "skip":
            _one_step(dm, st, run, 2)
            out["after_skip"] = (opt.step(run.lr).skipped, opt.step_count, opt.skipped_steps, dm.check_param_hashes())

    # expert parallelism: groups, reduction over expert-dp only, one global norm counting each element once
    st2 = build_parallel_state(2)
    out["ep_groups"] = (st2.dp.ranks, st2.ep.ranks, st2.expert_dp.ranks, st2.ep_rank)
    run = Run(clip_grad=0.0)
    model, dm, opt = make(st2, ParallelConfig(use_distributed_optimizer=False), run)
    dm.zero_grad_buffer()
    forward_backward(dm, st2, run, 0)
    local = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    dm.finish_grad_sync()
    everyone = all_gather_object(local, st2.dp)
    ok, expected_sq = True, 0.0
    for n, p in model.named_parameters():
        if getattr(p, "expert_parallel", False):
            ok &= torch.equal(p.main_grad, local[n] * 0.5)  # scaled by 1/dp, not reduced across ep ranks
            expected_sq += sum(float((g[n].double() * 0.5).square().sum()) for g in everyone)
        else:
            mean = (everyone[0][n] * 0.5 + everyone[1][n] * 0.5)
            ok &= torch.equal(p.main_grad, mean)
            expected_sq += float(p.main_grad.double().square().sum())
    norm = opt.step(run.lr).grad_norm
    out["ep_reduce"] = (ok, abs(norm - expected_sq**0.5) / expected_sq**0.5)
    experts = all_gather_object(model.experts.weight.detach().clone(), st2.dp)
    out["ep_params"] = (not torch.equal(experts[0], experts[1]), dm.check_param_hashes())
    sharded = train(st2, ParallelConfig(bucket_size=300), run)
    plain = train(st2, ParallelConfig(bucket_size=300, use_distributed_optimizer=False), run)
    out["ep_distopt_vs_plain"] = max_rel_diff(sharded["params"], plain["params"])

    # a forced sync with real async gathers in flight finalises them
    run = Run()
    model, dm, opt = make(st, ParallelConfig(overlap_param_gather=True, bucket_size=300), run,
                          storage=lambda n, p: AliasedStagingStorage())
    _one_step(dm, st, run, 0)
    opt.step(run.lr)
    dm.zero_grad_buffer()
    for g in dm.forward_order:
        g.dispatch()
    in_flight = all(g.state is ParamSyncState.DISPATCHED and g.sync.handles for g in dm.bucket_groups)
    dm.force_param_sync()
    masters = opt.gather_logical_state()["params"]
    out["forced_in_flight"] = (
        in_flight,
        all(g.state is ParamSyncState.POST_PROCESSED for g in dm.bucket_groups),
        all(bool(torch.all(b.grad_data == 0)) for b in dm.buffers),
        all(torch.equal(p, masters[n]["master"]) for n, p in model.named_parameters()),
    )
    return out


@pytest.fixture(scope="module")
def failures() -> list[dict[str, Any]]:
    return run_distributed(_failure_and_ep_body, world_size=2, timeout=120)


def test_one_ranks_nonfinite_grad_stops_every_rank(failures: list[dict[str, Any]]) -> None:
    assert [r["stop"] for r in failures] == [("raised", True)] * 2


def test_one_ranks_nonfinite_grad_skips_on_every_rank_with_state_unchanged(failures: list[dict[str, Any]]) -> None:
    assert [r["skip"] for r in failures] == [("skipped", True)] * 2
    assert [r["after_skip"] for r in failures] == [(False, 2, 1, [])] * 2


def test_expert_parallel_groups(failures: list[dict[str, Any]]) -> None:
    assert [r["ep_groups"] for r in failures] == [((0, 1), (0, 1), (0,), 0), ((0, 1), (0, 1), (1,), 1)]


def test_expert_grads_reduce_over_expert_dp_and_the_norm_counts_each_element_once(
        failures: list[dict[str, Any]]) -> None:
    for r in failures:
        ok, norm_rel = r["ep_reduce"]
        assert ok and norm_rel < 1e-6  # fp32 per-bucket norms; a double count would be off by far more
        differ, mismatches = r["ep_params"]
        assert differ and mismatches == []  # experts differ across ep ranks; replicas (none here) agree
        assert r["ep_distopt_vs_plain"] < 1e-6


def test_forced_sync_finalises_gathers_in_flight(failures: list[dict[str, Any]]) -> None:
    for r in failures:
        assert r["forced_in_flight"] == (True, True, True, True)
