"""The device-time split of `bench train`: interval arithmetic on made-up kernels, and region attribution
(forward ranges, backward through autograd sequence numbers) on a real CPU profile of a tiny model step."""

from __future__ import annotations

import pytest
import torch

from moectl.bench.device_time import Activity, activities, covered, split, union
from moectl.core.config.load import load_config
from trainer import regions
from trainer.loop import Trainer
from trainer.observer import SilentObserver

NCCL = "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL"
GEMM = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN"
ADD = "vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>"


def test_union_and_covered():
    merged = union([(5, 7), (0, 2), (1, 3), (3, 4), (10, 12)])
    assert merged == [(0, 4), (5, 7), (10, 12)]
    starts = [s for s, _ in merged]
    assert covered(2, 11, merged, starts) == 2 + 2 + 1
    assert covered(7, 10, merged, starts) == 0
    assert covered(-5, 100, merged, starts) == 4 + 2 + 2


def test_split_two_streams_and_partly_hidden_communication():
    """Two steps. Stream 7: a GEMM [0, 10) and an add [12, 14) per step; stream 9: a reduce-scatter [8, 16)
    that overlaps the GEMM for 2 us and the add for 2 us, and is alone for 4 us."""
    acts = []
    for off in (0, 100):
        acts += [
            Activity(GEMM, off + 0, off + 10, 7, ("aten::mm",), "attention"),
            Activity(ADD, off + 12, off + 14, 7, ("aten::add",), "attention"),
            Activity(NCCL, off + 8, off + 16, 9, (), "optimizer.step"),
        ]
    s = split(acts, steps=2)
    ms = 1e-3
    assert s.category_ms["dense_gemm"] == pytest.approx(10 * ms)
    assert s.category_ms["elementwise"] == pytest.approx(2 * ms)
    assert s.category_ms["comm"] == pytest.approx(8 * ms)
    assert s.comm_overlapped_ms == pytest.approx(4 * ms) and s.comm_exposed_ms == pytest.approx(4 * ms)
    assert s.busy_ms == pytest.approx(16 * ms)  # [0, 16): no gap
    assert s.concurrent_ms == pytest.approx((20 - 16) * ms)  # kernel time 20, busy 16
    assert s.kernels_per_step == 3
    assert s.top["dense_gemm"][0] == {"name": GEMM, "ms": pytest.approx(10 * ms), "calls": 1}
    # the rows of the table add up to the step: categories - concurrent + idle
    step_ms = 30 * ms
    idle = step_ms - s.busy_ms
    assert sum(s.category_ms.values()) - s.concurrent_ms + idle == pytest.approx(step_ms)


@pytest.fixture(scope="module")
def cpu_profile():
    cfg = load_config("configs/tiny.yaml", [
        "train.eval_interval=null", "model.num_layers=1", "train.global_batch_size=4", "model.seq_length=32",
        "data.source=synthetic", "parallel.gradient_accumulation_fusion=true",  # the fused expert grads go through grad.accumulate
    ])  # fmt: skip
    t = Trainer(cfg, SilentObserver())
    t.train_step(0)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t.train_step(1)
    return list(prof.events())


def test_regions_cover_forward_and_backward(cpu_profile):
    acts = activities(cpu_profile, regions.ALL, device="cpu")
    by_region = {a.region for a in acts}
    # every region of the model and the loop shows up (embedding: the lookup; model.head: the final norm and head)
    assert set(regions.ALL) - {regions.DENSE_MLP} <= by_region, set(regions.ALL) - by_region
    backward = [a for a in acts if any(op.startswith("autograd::engine::evaluate_function") for op in a.ops)]
    assert backward
    # backward work is attributed through its node's sequence number to the forward region that made it
    sdpa_bwd = [a for a in backward if "scaled_dot_product" in a.name and "backward" in a.name]
    assert sdpa_bwd and {a.region for a in sdpa_bwd} == {regions.ATTENTION}
    expert_bwd = [a for a in backward if any("_ExpertMLPFunctionBackward" in op for op in a.ops)]
    assert expert_bwd and {a.region for a in expert_bwd} <= {regions.EXPERTS, regions.GRAD_ACCUMULATE}
    index_bwd = [a for a in backward if "index" in a.name]
    assert index_bwd and {a.region for a in index_bwd} <= {regions.DISPATCH, regions.COMBINE}
    accumulate = [a for a in backward if any(op.endswith("AccumulateGrad") for op in a.ops)]
    assert accumulate and {a.region for a in accumulate} == {regions.GRAD_ACCUMULATE}
    # backward work lands in regions (what does not: the loop's `loss / n_micro` and its reshapes); so does
    # the rest, but for the loop's own work: the grad-buffer zeroing that opens the step (as the first op
    # after the profiler starts it also absorbs the profiler's start-up), the loss bookkeeping, the data copy
    assert sum(a.us for a in backward if a.region is None) < 0.03 * sum(a.us for a in backward)
    work = [a for a in acts if a.name != "aten::zero_" or a.ops[1:]]
    assert sum(a.us for a in work if a.region is None) < 0.1 * sum(a.us for a in work)
    cats = split(acts, 1).category_ms
    for key in ("dense_gemm", "grouped_gemm", "attention", "router", "dispatch", "loss", "optimizer", "grad_accum"):
        assert cats[key] > 0, key


def test_regions_are_free_without_a_profiler():
    assert regions.region(regions.ATTENTION) is regions._NULL
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with regions.region("moe.experts"):
            torch.ones(2).add_(1)
    assert any(e.name == "moe.experts" and e.is_user_annotation for e in prof.events())


def test_kernels_find_their_launching_op_and_region_by_correlation_id():
    """The structure torch 2.11 reports on an H100 (scripts/probes/profiler_events.py): a kernel shares its
    `id` with the runtime call that queued it, whose parent is the aten op inside the region's range; aten
    ops number their own ids, which may equal some kernel's, and must not be taken for launches."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(name, id, device, parent=None, user=False, start=0, end=1, seq=-1):
        return SimpleNamespace(name=name, id=id, device_type=device, cpu_parent=parent, is_user_annotation=user,
                               is_async=False, sequence_nr=seq, thread=1, device_resource_id=7,
                               time_range=SimpleNamespace(start=start, end=end))

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    reg = ev(regions.ATTENTION, 1, cpu, user=True, start=0, end=50)
    mm = ev("aten::mm", 2, cpu, reg, start=1, end=10, seq=0)
    launch = ev("cudaLaunchKernelExC", 1350, cpu, mm, start=2, end=3)
    decoy = ev("aten::add", 1351, cpu, None, start=60, end=61)  # an aten op whose id equals a kernel's
    kernel = ev(GEMM, 1350, cuda, start=100, end=200)
    orphan = ev(ADD, 1351, cuda, start=300, end=310)  # its launch was not recorded
    acts = {a.name: a for a in activities([reg, mm, launch, decoy, kernel, orphan], regions.ALL)}
    assert acts[GEMM].region == regions.ATTENTION and acts[GEMM].ops[0] == "aten::mm"
    assert acts[ADD].region is None and acts[ADD].ops == ()


def test_gpu_copies_of_host_ranges_are_not_counted_as_work():
    """On 4 H100s c10d's `nccl:all_to_all` range came back as a CUDA event spanning its NCCL kernel, not
    flagged as a user annotation: counted as communication it doubled every collective's time."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(name, id, device, parent=None, user=False, start=0, end=1):
        return SimpleNamespace(name=name, id=id, device_type=device, cpu_parent=parent, is_user_annotation=user,
                               is_async=False, sequence_nr=-1, thread=1, device_resource_id=7,
                               time_range=SimpleNamespace(start=start, end=end))

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    op = ev("nccl:all_to_all", 5, cpu, start=0, end=20)
    launch = ev("cudaLaunchKernel", 900, cpu, op, start=1, end=2)
    kernel = ev("ncclDevKernel_SendRecv", 900, cuda, start=100, end=200)
    mirror = ev("nccl:all_to_all", 901, cuda, start=100, end=200)
    flagged = ev("moe.experts", 902, cuda, user=True, start=100, end=200)
    triton_range = ev("triton_poi_fused_add_0", 6, cpu, start=30, end=31)  # inductor's range per launch
    triton_kernel = ev("triton_poi_fused_add_0", 903, cuda, start=300, end=310)
    acts = activities([op, launch, kernel, mirror, flagged, triton_range, triton_kernel], regions.ALL)
    assert [a.name for a in acts] == ["ncclDevKernel_SendRecv", "triton_poi_fused_add_0"]
    assert split(acts, 1).category_ms["comm"] == pytest.approx(0.1)  # ms
