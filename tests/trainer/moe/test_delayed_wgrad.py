"""`moe.delay_wgrad_compute`: expert weight grads after the data grads, bitwise the grads of the plain backward.

- every backend (loop, grouped, fused) without a recipe and under fp8 tensorwise, delayed and mxfp8, both
  expert layouts, fused and unfused grad accumulation, two micro-batches: the layer's input grad, the
  router's grad and every expert param's accumulated grad equal the undelayed run's bitwise, and every
  param reports its grad (`grad_ready`) exactly once per backward;
- the weight grads arrive at the dispatcher's flush point, inside the backward before the layer's input
  grad is complete, not at the end-of-backward backstop; the backstop alone still delivers them;
- a backend without `backward_dgrad` is refused by name.
Whole runs (Trainer, 2 ranks, expert parallelism with the all-to-all overlap, overlap_grad_reduce) are in
tests/trainer/distributed/test_dist_delayed_wgrad.py.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from moectl.core.config.schema import MoEConfig
from moectl.core.errors import MoectlError
from trainer.main_grad import READY_HOOK, attach_main_grads
from trainer.moe import MoELayer
from trainer.moe import backends as eb
from trainer.moe import delayed_wgrad
from trainer.precision import DelayedRecipe, MXFP8Recipe, Recipe, TensorwiseRecipe

D, F, E = 64, 32, 4
RECIPES: dict[str, Any] = {"none": lambda: None, "tensorwise": TensorwiseRecipe, "delayed": DelayedRecipe,
                           "mxfp8": MXFP8Recipe}  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def layer(backend: str, recipe: Optional[Recipe], grouped: bool, fuse: bool, delay: bool,
          device: str = "cpu", dtype: torch.dtype = torch.float32) -> MoELayer:  # fmt: skip
    cfg = MoEConfig(num_experts=E, ffn_hidden_size=F, add_bias=True, single_grouped_weight=grouped,
                    single_grouped_bias=grouped, backend=backend, delay_wgrad_compute=delay)  # fmt: skip
    align = recipe.align_size if recipe is not None else 1
    m = MoELayer(cfg, D, init_std=0.2, generator=torch.Generator().manual_seed(3), gradient_accumulation_fusion=fuse,
                 align=align, recipe=recipe, params_dtype=dtype)  # fmt: skip
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # non-zero biases, so their grads and p * b2's share of dprobs are exercised
        for p in m.experts.parameters():
            if p.dim() <= 2 and "bias" in [n for n, q in m.experts.named_parameters() if q is p][0]:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return m.to(device)


def run(m: MoELayer, micro: int = 2) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Input and param grads after `micro` forward/backward passes (main_grad), and the grad_ready reports."""
    attach_main_grads(m)
    names = {p: n for n, p in m.named_parameters()}
    reports: list[str] = []
    for p in names:
        setattr(p, READY_HOOK, lambda q: reports.append(names[q]))
    g = torch.Generator().manual_seed(5)
    out: dict[str, torch.Tensor] = {}
    ref = next(m.experts.parameters())
    for i in range(micro):
        x = torch.randn(2, 16, D, generator=g).to(ref.device, ref.dtype).requires_grad_(True)
        m(x).square().mean().backward()
        out[f"x.grad.{i}"] = x.grad
    out.update({n: p.main_grad.clone() for p, n in names.items()})
    return out, reports


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("backend", ["loop", "grouped", "fused"])
def test_delayed_equals_plain_bitwise(backend: str, recipe: str) -> None:
    for grouped, fuse in ((True, False), (False, True)):
        plain, plain_reports = run(layer(backend, RECIPES[recipe](), grouped, fuse, delay=False))
        m = layer(backend, RECIPES[recipe](), grouped, fuse, delay=True)
        delayed, reports = run(m)
        assert plain.keys() == delayed.keys()
        bad = [n for n in plain if not torch.equal(plain[n], delayed[n])]
        assert bad == [], (grouped, fuse, bad)
        assert sorted(reports) == sorted(plain_reports)  # every param reported, as often as without delay
        assert len(reports) == 2 * len(list(m.parameters()))  # once per backward (2 micro-batches)
        assert m.experts.delayed.flushes == 2 and m.experts.delayed.pending == 0


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["none", "tensorwise", "mxfp8"])
@pytest.mark.parametrize("backend", ["grouped", "fused"])
def test_delayed_equals_plain_bitwise_on_gpu(backend: str, recipe: str) -> None:
    """CUDA, bf16: the fused backend's Triton activation kernels and its side-stream weight grads (plain)
    against the delayed split on the main stream; native fp8 grouped GEMMs under tensorwise."""
    for grouped, fuse in ((True, False), (False, True)):
        make = lambda delay: layer(backend, RECIPES[recipe](), grouped, fuse, delay, "cuda", torch.bfloat16)  # noqa: E731
        plain, plain_reports = run(make(False))
        delayed, reports = run(make(True))
        bad = [n for n in plain if not torch.equal(plain[n], delayed[n])]
        assert bad == [], (grouped, fuse, bad)
        assert sorted(reports) == sorted(plain_reports)


def test_weight_grads_arrive_at_the_flush_point_not_the_backstop(monkeypatch: pytest.MonkeyPatch) -> None:
    def order(m: MoELayer) -> list[str]:
        attach_main_grads(m)
        events: list[str] = []
        for p in m.experts.parameters():
            setattr(p, READY_HOOK, lambda q: events.append("expert grad"))
        x = torch.randn(2, 16, D, generator=torch.Generator().manual_seed(5), requires_grad=True)
        x.register_hook(lambda g: events.append("input grad"))
        m(x).square().mean().backward()
        return events

    events = order(layer("grouped", None, True, True, delay=True))
    assert events.index("input grad") > events.index("expert grad")  # delivered inside the backward
    # with the flush point gone, the backstop at the end of the backward still delivers every grad
    monkeypatch.setattr(delayed_wgrad._FlushPoint, "backward", staticmethod(lambda ctx, grad: (grad, None)))
    m = layer("grouped", None, True, True, delay=True)
    events = order(m)
    assert events.count("expert grad") == len(list(m.experts.parameters())) and events[0] == "input grad"


def test_a_backend_without_backward_dgrad_is_refused() -> None:
    class NoSplit:
        name = "nosplit"

        def forward(self, *a: Any) -> Any: ...

        def backward(self, *a: Any) -> Any: ...

    eb.register_backend("nosplit", NoSplit)
    try:
        m = layer("nosplit", None, True, False, delay=True)
        with pytest.raises(MoectlError, match="cannot delay its weight grads"):
            m(torch.randn(1, 4, D))
    finally:
        eb._REGISTRY.pop("nosplit")
