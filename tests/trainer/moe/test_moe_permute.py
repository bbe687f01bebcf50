"""Dispatch and combine move rows by gathers only (trainer/moe/permute.py): their values and grads equal a
routing-by-routing reference, and neither direction scatter-adds (index_put with accumulate, index_add)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.moe import LocalDispatcher, RouterOutput

T, K, E, D = 9, 2, 3, 5
CASES = [{}, {"align": 4}, {"capacity_factor": 0.75}, {"capacity_factor": 0.75, "align": 4},
         {"capacity_factor": 0.75, "pad_to_capacity": True}]  # fmt: skip


def _routed(g: torch.Generator) -> tuple[torch.Tensor, RouterOutput]:
    probs, idx = torch.rand(T, E, generator=g, dtype=torch.float64).topk(K, dim=-1)
    probs.requires_grad_()
    return probs, RouterOutput(probs, idx, torch.bincount(idx.flatten(), minlength=E), torch.zeros(()), torch.zeros(()))


def _reference(x: torch.Tensor, probs: torch.Tensor, idx: torch.Tensor, w_E: torch.Tensor,
               kept: set[tuple[int, int]]) -> torch.Tensor:
    """y_t = sum over kept (t, k) of probs[t, k] * w[e] * x_t, routing by routing."""
    rows = []
    for t in range(T):
        y = x.new_zeros(D)
        for k in range(K):
            if (t, k) in kept:
                y = y + probs[t, k] * w_E[idx[t, k]] * x[t]
        rows.append(y)
    return torch.stack(rows)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.add(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kw", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) or "plain" for c in CASES])
def test_values_and_grads_equal_the_reference_and_backward_only_gathers(kw: dict) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, D, generator=g, dtype=torch.float64, requires_grad=True)
    probs, ro = _routed(g)
    w_E = torch.randn(E, D, generator=g, dtype=torch.float64)
    dy = torch.randn(T, D, generator=g, dtype=torch.float64)
    disp = LocalDispatcher(E, **kw)
    x_PD, rows_E, probs_P, plan = disp.dispatch(x, ro)
    expert_P = torch.repeat_interleave(torch.arange(E), rows_E)
    y = disp.combine(x_PD * w_E[expert_P] * probs_P[:, None], plan)
    kept = {(int(n) // K, int(n) % K) for n in range(T * K) if int(plan.row_N[n]) < plan.num_rows}
    if "capacity_factor" not in kw:
        assert len(kept) == T * K
    ref = _reference(x, probs, ro.indices_TK, w_E, kept)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    ops = _Ops()
    with ops:
        gx, gp = torch.autograd.grad(y, (x, probs), dy)
    assert not {"index_put_.default", "index_put.default", "index_add_.default", "index_add.default"} & ops.names
    rx, rp = torch.autograd.grad(ref, (x, probs), dy)
    torch.testing.assert_close(gx, rx, rtol=0, atol=1e-12)
    torch.testing.assert_close(gp, rp, rtol=0, atol=1e-12)
    if kw.get("align", 1) > 1 or kw.get("pad_to_capacity"):
        pad = plan.src_P == T * K
        assert pad.any() and not x_PD[pad].any() and not probs_P[pad].any()


@pytest.mark.gpu
@pytest.mark.parametrize("kw", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) or "plain" for c in CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_gather_sum_equals_the_torch_ops_bitwise(kw: dict, dtype: torch.dtype,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the combine and the dispatch's backward run one Triton gather-sum kernel
    (kernels/gather_sum_triton.py); it sums the K rows in fp32 in torch's order and rounds once, so its values
    and grads are torch's bit for bit, with dropped routings and padding rows. (Shapes of a real layer:
    several output tiles, K = 4.)"""
    from trainer.kernels import has_triton

    if not has_triton():
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(2)
    T_, K_, E_, D_ = 300, 4, 8, 320
    probs, idx = torch.rand(T_, E_, generator=g).topk(K_, dim=-1)
    ro = RouterOutput(probs.cuda(), idx.cuda(), torch.bincount(idx.flatten(), minlength=E_).cuda(), torch.zeros(()),
                      torch.zeros(()))  # fmt: skip
    x = torch.randn(T_, D_, generator=g).to("cuda", dtype)
    dy = torch.randn(T_, D_, generator=g).to("cuda", dtype)
    out = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("MOECTL_TRITON_GATHER_SUM", fused)
        xr, pr = x.clone().requires_grad_(), ro.probs_TK.clone().requires_grad_()
        disp = LocalDispatcher(E_, **kw)
        x_PD, rows_E, probs_P, plan = disp.dispatch(xr, dataclasses.replace(ro, probs_TK=pr))
        y = disp.combine(x_PD * probs_P[:, None].to(dtype), plan)  # the probs' dispatch: K = 1, D = 1, fp32
        y.backward(dy)
        out[fused] = (y.detach(), xr.grad, pr.grad)
    for a, b in zip(out["1"], out["0"]):
        assert torch.equal(a, b)
