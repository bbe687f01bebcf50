"""`GroupedMLP.chunked`: one layer's expert rows run in n calls (the overlapped ep exchange) are the rows run in
one call, and every param reports its grad once per backward.

The expert MLP maps each row alone, so a chunk's outputs are the matching rows of the whole call's (fp32,
rounding only: a GEMM over fewer rows may sum in another order); the weight grads are sums over rows, here
in n parts. Grad buckets count one `grad_ready` per param per backward and refuse a second
(`BucketGroup.grad_ready`): without `chunked`, n calls would report n times. Every backend, both layouts,
fused and unfused weight-grad accumulation (only the fused path reports from inside the backward).
"""

from __future__ import annotations

import pytest
import torch

from moectl.core.config.schema import MoEConfig
from trainer.main_grad import READY_HOOK, attach_main_grads
from trainer.moe import GroupedMLP
from trainer.moe.experts import ChunkReports

D, F, E, ROWS, CHUNKS = 32, 16, 4, 12, 3  # ROWS per expert, split in CHUNKS runs of 4
TOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def experts(backend: str, grouped: bool, fuse: bool) -> tuple[GroupedMLP, list[str]]:
    cfg = MoEConfig(num_experts=E, ffn_hidden_size=F, add_bias=True, single_grouped_weight=grouped,
                    single_grouped_bias=grouped, backend=backend)  # fmt: skip
    m = GroupedMLP(cfg, D, init_std=0.2, generator=torch.Generator().manual_seed(1), gradient_accumulation_fusion=fuse)
    attach_main_grads(m)
    names = {p: n for n, p in m.named_parameters()}
    reports: list[str] = []
    for p in names:
        setattr(p, READY_HOOK, lambda q: reports.append(names[q]))
    return m, reports


def rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, ROWS, D, generator=g), torch.rand(E, ROWS, generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("backend", ["loop", "grouped", "fused"])
@pytest.mark.parametrize(("grouped", "fuse"), [(True, False), (False, True), (True, True)])
def test_chunks_equal_one_call_and_report_once(backend: str, grouped: bool, fuse: bool) -> None:
    x_ERD, p_ER = rows(2)
    whole, whole_reports = experts(backend, grouped, fuse)
    x1 = x_ERD.clone().requires_grad_(True)
    y1 = whole(x1.reshape(-1, D), torch.full((E,), ROWS), p_ER.reshape(-1), ROWS).view(E, ROWS, D)
    y1.square().sum().backward()

    parts, reports = experts(backend, grouped, fuse)
    c = ROWS // CHUNKS
    x2 = x_ERD.clone().requires_grad_(True)
    with parts.chunked(CHUNKS):
        ys = [parts(x2[:, i * c:(i + 1) * c].reshape(-1, D), torch.full((E,), c), p_ER[:, i * c:(i + 1) * c].reshape(-1),
                    c).view(E, c, D) for i in range(CHUNKS)]  # fmt: skip
    y2 = torch.cat(ys, dim=1)
    y2.square().sum().backward()

    assert _rel(y2, y1) <= TOL
    assert _rel(x2.grad, x1.grad) <= TOL
    params1, params2 = dict(whole.named_parameters()), dict(parts.named_parameters())
    bad = {n: _rel(p.main_grad, params1[n].main_grad) for n, p in params2.items()
           if _rel(p.main_grad, params1[n].main_grad) > TOL}  # fmt: skip
    assert bad == {}
    assert sorted(reports) == sorted(whole_reports) and len(reports) == len(params2)  # once each
    assert parts._chunk_reports is None  # the scope ended


def test_chunk_reports_count_down_and_refuse_an_extra_backward() -> None:
    r = ChunkReports(3)
    assert [r.last(), r.last(), r.last()] == [False, False, True]
    with pytest.raises(RuntimeError, match="more expert backwards"):
        r.last()


def test_delayed_wgrad_is_refused() -> None:
    cfg = MoEConfig(num_experts=E, ffn_hidden_size=F, delay_wgrad_compute=True)
    m = GroupedMLP(cfg, D, delay_wgrad=True)
    with pytest.raises(ValueError, match="delayed wgrad"):
        with m.chunked(2):
            pass
