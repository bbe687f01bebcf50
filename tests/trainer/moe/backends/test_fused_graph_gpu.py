"""The fused expert MLP's CUDA path captures in a CUDA graph and replays like eager (GPU only).

The trainer's graphs (`train.cuda_graph`, tests/trainer/graphs) stand on this kernel-level check. The forward and
backward must not read anything on the host (token counts, amaxes, scales stay on the device), and every
value that changes between micro-batches must be read from a tensor at replay, not baked in at capture
(seed 003). So: capture one forward + backward, then write new activations, routing probs, upstream grads
and a different split of the rows over the experts into the captured inputs, replay, and compare with an
eager call on the same data, bit for bit.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch

from moectl.bench.backend_function import BackendFunction
from trainer.moe.backends.fused import FusedBackend
from trainer.moe.expert_math import ExpertSpec
from trainer.moe.expert_precision import ExpertPrecision
from trainer.precision import TensorwiseRecipe

gpu = pytest.mark.gpu
E, D, F = 4, 256, 384
SPLITS = ([128, 0, 64, 192], [64, 192, 128, 0], [96, 96, 96, 96])  # rows per expert; 384 rows, multiples of 16


def _step(w1: torch.Tensor, w2: torch.Tensor, recipe: Optional[Any]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """fn(x, probs, counts, dy) -> (y, dx, dw1, dw2, dprobs): one forward + backward of the fused backend."""
    backend = FusedBackend(torch.device("cuda"), overlap_wgrad=True)  # the side stream is captured too
    spec = ExpertSpec("swiglu", F, None)
    make = None if recipe is None else (lambda: ExpertPrecision(recipe))

    def fn(x: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, probs = x.detach().requires_grad_(), probs.detach().requires_grad_()
        y = BackendFunction.apply(x, w1, w2, probs, counts, backend, spec, make)
        return (y.detach(), *torch.autograd.grad(y, [x, w1, w2, probs], dy))

    return fn


def _batch(seed: int, split: list[int]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(split)
    x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    probs = torch.rand(T, device="cuda", generator=g)
    dy = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    return x, probs, torch.tensor(split, device="cuda"), dy


@gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8_tensorwise_fast_accum"])
def test_fused_expert_mlp_replays_a_captured_graph_like_eager(precision: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = (torch.randn(E, 2 * F, D, device="cuda", generator=g) * D**-0.5).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(E, D, F, device="cuda", generator=g) * F**-0.5).to(torch.bfloat16).requires_grad_()
    recipe = None if precision == "bf16" else TensorwiseRecipe(emulate="never", fast_accum_backward=True)
    fn = _step(w1, w2, recipe)
    static = [t.clone() for t in _batch(1, SPLITS[0])]  # the captured inputs: x, probs, counts, dy
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as capture requires
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(*static)
    for seed, split in zip((2, 3, 4), SPLITS):
        batch = _batch(seed, split)
        for buf, new in zip(static, batch):
            buf.copy_(new)
        graph.replay()
        want = fn(*batch)
        torch.cuda.synchronize()
        for name, got, ref in zip(("y", "dx", "dw1", "dw2", "dprobs"), outs, want):
            assert torch.isfinite(ref.float()).all(), name
            assert torch.equal(got, ref), (precision, split, name)
        for e, rows in enumerate(split):  # the replay read this split: empty experts, and only they, get zero
            assert (torch.count_nonzero(outs[2][e]) == 0) == (rows == 0), (precision, split, e)
