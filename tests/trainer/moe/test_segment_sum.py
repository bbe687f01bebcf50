"""Per-expert row sums (`expert_math.segment_sum`, the expert biases' grads) against an fp64 oracle.

CPU: `torch.segment_reduce` and the one-hot product (the CUDA path without Triton). GPU (marked `gpu`): the
Triton kernel, with empty experts, a ragged width, strided and bf16 input, rows past the counts' total that
must not be read (NaN there), the same bits twice, and inside a CUDA graph whose replay reads new counts
from the same tensor (what MOE066 used to refuse: segment_reduce copied them to the host). A kernel that
read the wrong segment, dropped a row block or the ragged tail errs by O(1), far over the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from trainer.moe import expert_math

COUNTS = [5, 0, 37, 1, 0, 70, 3]  # empty experts, a segment shorter and longer than a kernel row block
TOL = 1e-5  # fp32 sums of <= 70 terms of size ~1, in another order than the fp64 oracle


def _oracle(v_TX: torch.Tensor, counts: list[int]) -> torch.Tensor:
    rows = v_TX.double().split(counts)
    return torch.stack([r.sum(0) for r in rows]).float().to(v_TX.device)


def _rows(x: int, device: str, dtype: torch.dtype = torch.float32, extra: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(0)
    return torch.randn(sum(COUNTS) + extra, x, device=device, generator=g).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = float((got - want).abs().max())
    assert err <= TOL * max(1.0, float(want.abs().max())), err


@pytest.mark.parametrize("fn", [expert_math.segment_sum, expert_math.segment_sum_one_hot])
def test_cpu_sums_match_the_oracle(fn) -> None:
    v = _rows(19, "cpu")
    _close(fn(v, torch.tensor(COUNTS, dtype=torch.int32)), _oracle(v, COUNTS))


gpu = pytest.mark.gpu
needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() or not expert_math.has_triton(), reason="needs CUDA and Triton"
)


@gpu
@needs_triton
@pytest.mark.parametrize("x", [128, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_the_kernel_matches_the_oracle_without_reading_past_the_counts(x: int, dtype: torch.dtype,
                                                                       strided: bool) -> None:  # fmt: skip
    from trainer.kernels import segment_sum_triton

    v = _rows(x, "cuda", dtype, extra=9)
    v[sum(COUNTS):] = float("nan")  # padding rows past the total: never read
    if strided:
        v = v.mT.contiguous().mT
        assert not v.is_contiguous()
    counts = torch.tensor(COUNTS, dtype=torch.int32, device="cuda")
    got = segment_sum_triton.segment_sum(v, counts)
    _close(got, _oracle(v[: sum(COUNTS)], COUNTS))
    assert torch.equal(got, segment_sum_triton.segment_sum(v, counts))
    # the dispatch entry point takes this kernel on CUDA
    assert torch.equal(expert_math.segment_sum(v, counts), got)


@gpu
@needs_triton
def test_a_graph_replay_reads_new_counts_from_the_device() -> None:
    v = _rows(256, "cuda")
    counts = torch.tensor(COUNTS, dtype=torch.int32, device="cuda")
    expert_math.segment_sum(v, counts)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = expert_math.segment_sum(v, counts)
    shuffled = [70, 3, 0, 5, 37, 1, 0]
    counts.copy_(torch.tensor(shuffled, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    _close(out, _oracle(v, shuffled))
