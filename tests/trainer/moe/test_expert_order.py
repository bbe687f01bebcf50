"""The stable order of routings by expert (trainer/moe/expert_order.py).

CPU: the torch path is the stable argsort and its inverse, on skewed keys with empty buckets. GPU (marked
`gpu`): the Triton counting sort (kernels/counting_sort_triton.py) gives the same permutation and inverse
bit for bit at the shapes the shipped configs route (E 8..256 buckets, up to 65,536 routings, with the
capacity's dropped bucket), and a dispatcher's whole plan and outputs are the same on either sort.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.moe import LocalDispatcher, RouterOutput
from trainer.moe.expert_order import sort_by_expert


def _keys(n: int, buckets: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Skewed keys: half the routings in bucket 1, the last bucket empty (unless there is one)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, max(1, buckets - 1), (n,), generator=g)
    keys[torch.rand(n, generator=g) < 0.5] = min(1, buckets - 1)
    return keys.to(device)


@pytest.mark.parametrize("n,buckets", [(0, 4), (1, 1), (37, 3), (1000, 9), (4096, 33)])
def test_torch_path_is_the_stable_argsort_and_its_inverse(n: int, buckets: int) -> None:
    keys = _keys(n, buckets, seed=n)
    order, inverse = sort_by_expert(keys, buckets)
    assert torch.equal(order, torch.argsort(keys, stable=True))
    assert torch.equal(order[inverse], torch.arange(n))
    assert order.dtype == inverse.dtype == torch.int64


@pytest.mark.gpu
@pytest.mark.parametrize("n,buckets", [(1, 1), (37, 3), (4096, 9), (32768, 32), (32768, 33), (65536, 128),
                                       (65536, 129), (100_003, 256), (5000, 300)])  # fmt: skip
def test_counting_sort_equals_the_stable_argsort(n: int, buckets: int) -> None:
    from trainer.kernels import has_triton

    if not has_triton():
        pytest.skip("needs Triton")
    from trainer.kernels.counting_sort_triton import counting_sort

    keys = _keys(n, buckets, seed=buckets, device="cuda")
    want = torch.argsort(keys, stable=True)
    # narrow keys too (compact_ids' uint8 holds 255: the masked tail of a block must not count as a key)
    for k in [keys, keys.int()] + ([keys.to(torch.uint8)] if buckets <= 256 else []):
        order, inverse = counting_sort(k, buckets)
        assert torch.equal(order, want)
        assert torch.equal(inverse[want], torch.arange(n, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, {"align": 16}, {"capacity_factor": 1.0}, {"capacity_factor": 0.75, "align": 16},
                                {"capacity_factor": 1.0, "pad_to_capacity": True}],
                         ids=["plain", "align", "capacity", "capacity,align", "pad"])  # fmt: skip
def test_dispatch_plan_is_the_same_on_either_sort(kw: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.kernels import has_triton

    if not has_triton():
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(4)
    T, K, E, D = 2048, 4, 32, 64
    logits = torch.randn(T, E, generator=g)
    logits[:, 3] += 2.0  # skew: expert 3 overflows a capacity
    probs, idx = logits.softmax(-1).topk(K, dim=-1)
    ro = RouterOutput(probs.cuda(), idx.cuda(), torch.bincount(idx.flatten(), minlength=E).cuda(), torch.zeros(()),
                      torch.zeros(()))  # fmt: skip
    x = torch.randn(T, D, generator=g).cuda()
    out = {}
    for triton_sort in ("1", "0"):
        monkeypatch.setenv("MOECTL_TRITON_SORT", triton_sort)
        xr = x.clone().requires_grad_()
        disp = LocalDispatcher(E, **kw)
        x_PD, rows_E, probs_P, plan = disp.dispatch(xr, dataclasses.replace(ro, probs_TK=ro.probs_TK.clone()))
        disp.combine(x_PD * probs_P[:, None], plan).square().sum().backward()
        out[triton_sort] = (x_PD, rows_E, probs_P, plan.order_R, plan.src_P, plan.row_N, plan.num_dropped, xr.grad)
    for a, b in zip(out["1"], out["0"]):
        assert torch.equal(a, b)
