"""`optimizer.muon_split_qkv`: a fused QKV weight orthogonalised as its query, key and value parts.

The reference is written here from the definition (Megatron-Core's `TensorParallelMuon.orthogonalize` with
`split_qkv`), not from the code under test: the Nesterov blend of the whole weight; per part, its rows picked
by explicit indices from every query group of Megatron's layout (group g holds rows `[g R, (g + 1) R)`, R =
q + 2 kv: q query rows, then kv key rows, then kv value rows), stacked in group order into one `[G r, in]`
matrix, the existing single-matrix `newton_schulz` on it (2-D GEMMs), the result put back by the same
indices; decoupled weight decay and the update on the whole weight with the part's Moonlight scale
`0.2 * sqrt(max(G r, in))`. Against it, CPU fp32, bitwise: the batched step (`muon_step_`, alone and batched
with other matrices of a part's shape), the verdict on the device (a skipped step changes nothing), the
layer-wise chain over a real model, the trainer's loop on vs off. Also: the model marks its QKV weights, the
layer-wise plan and the FLOP count see the parts. The fused kernels' row-block views are GPU tests
(tests/trainer/kernels/test_muon_triton.py).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_muon import trainer  # noqa: E402

from moectl.core.facts import QKV_ROWS_ATTR, QkvRows  # noqa: E402
from trainer.optim.muon import newton_schulz, ns_cost, ns_flops, qkv_parts, qkv_split_shapes  # noqa: E402
from trainer.optim.muon_batch import MuonMatrix, batches, muon_step_, qkv_matrices  # noqa: E402
from trainer.optim.muon_routing import muon_cost, muon_ns_shapes, qkv_rows, split_qkv_rows  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # small GEMMs, and one thread keeps elementwise ops alike

HP = dict(lr=0.02, momentum=0.9, ns_steps=5, weight_decay=0.1)


# --- the reference ------------------------------------------------------------------------------------
def part_rows(rows: QkvRows) -> list[list[int]]:
    """The row indices of the query, key and value parts, each part's rows of group 0, then group 1, ..."""
    out = []
    for lo, hi in ((0, rows.q), (rows.q, rows.q + rows.kv), (rows.q + rows.kv, rows.q + 2 * rows.kv)):
        out.append([g * rows.group_rows + r for g in range(rows.groups) for r in range(lo, hi)])
    return out


def ref_split_step(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, rows: QkvRows, nesterov: bool,
                   lr: float, momentum: float, ns_steps: int, weight_decay: float) -> None:
    """Muon on a fused QKV `p` with its query, key and value parts orthogonalised alone, each scaled by its own
    Moonlight factor."""
    buf.lerp_(g, 1 - momentum)
    update = torch.lerp(g, buf, momentum) if nesterov else buf
    orthos = [(idx, newton_schulz(update[idx], ns_steps)) for idx in part_rows(rows)]
    p.mul_(1 - lr * weight_decay)
    for idx, ortho in orthos:
        p[idx] = p[idx].add(ortho, alpha=-lr * 0.2 * math.sqrt(max(len(idx), p.size(1))))


# (rows, in): G 2 groups of 2 query heads of dim 4 (q 8, kv 4) into 16; GQA with more groups and a value part
# taller than wide; one group (the parts are consecutive row ranges); multi-head attention (q = kv)
LAYOUTS = [(QkvRows(2, 8, 4), 16), (QkvRows(4, 8, 4), 12), (QkvRows(1, 16, 8), 24), (QkvRows(3, 4, 4), 8)]


def _triple(gen: torch.Generator, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(shape, generator=gen) for _ in range(3))


# --- the step against the reference -------------------------------------------------------------------
def test_parts_are_row_block_views_in_megatrons_order() -> None:
    rows = QkvRows(2, 8, 4)
    w = torch.arange(2 * 16 * 3).view(32, 3)
    q, k, v = qkv_parts(w, rows)
    assert [tuple(t.shape) for t in (q, k, v)] == [(2, 8, 3), (2, 4, 3), (2, 4, 3)]
    for part, idx in zip((q, k, v), part_rows(rows)):
        assert torch.equal(part.reshape(-1, 3), w[idx]) and part.data_ptr() >= w.data_ptr()  # views, no copy
    assert qkv_split_shapes((32, 3), rows) == [(16, 3), (8, 3), (8, 3)]
    with pytest.raises(ValueError, match="2 groups of 16 rows"):
        qkv_parts(torch.zeros(30, 3), rows)
    with pytest.raises(ValueError, match="2 groups of 16 rows"):
        qkv_split_shapes((2, 32, 3), rows)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("rows,cols", LAYOUTS, ids=["gqa", "gqa4", "one-group", "mha"])
def test_split_step_is_bitwise_the_reference(rows: QkvRows, cols: int, nesterov: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (rows.groups * rows.group_rows, cols)
    p, buf, _ = _triple(gen, shape)
    master, grad, mom, pub = p.clone(), torch.empty(shape), buf.clone(), torch.empty(shape, dtype=torch.bfloat16)
    mats = qkv_matrices(master, grad, mom, rows, pub)
    assert [m.shape for m in mats] == qkv_split_shapes(shape, rows) and all(m.stacked for m in mats)
    for _ in range(3):
        g = torch.randn(shape, generator=gen)
        grad.copy_(g)
        muon_step_(mats, nesterov=nesterov, compute_dtype=torch.float32, **HP)  # type: ignore[arg-type]
        ref_split_step(p, g, buf, rows, nesterov, **HP)  # type: ignore[arg-type]
        assert torch.equal(grad, g)  # an input only
    assert torch.equal(master, p) and torch.equal(mom, buf), rows
    assert torch.equal(pub, p.to(torch.bfloat16))  # every row published, cast


def test_parts_join_the_batch_of_their_shape_without_changing_its_bits() -> None:
    """A query part `[G q, in]` joins the batch of the other matrices of that shape (the output projection's,
    at the reference model's sizes), the key and value parts one batch of theirs; each keeps its own bits."""
    rows, cols = QkvRows(2, 8, 4), 16
    gen = torch.Generator().manual_seed(1)
    p, buf, _ = _triple(gen, (32, cols))
    other, other_buf, _ = _triple(gen, (16, cols))  # an unrelated [G q, in] matrix
    mats = qkv_matrices(p.clone(), torch.empty(32, cols), buf.clone(), rows)
    lone = MuonMatrix(other.clone(), torch.empty(16, cols), other_buf.clone())
    assert [len(run) for run in batches([*mats, lone])] == [2, 2]  # [16, in]: q + other; [8, in]: k + v
    for _ in range(3):
        g, go = torch.randn(32, cols, generator=gen), torch.randn(16, cols, generator=gen)
        for m, part in zip(mats, qkv_parts(g, rows)):
            m.grad.copy_(part)
        lone.grad.copy_(go)
        muon_step_([*mats, lone], nesterov=True, compute_dtype=torch.float32, **HP)  # type: ignore[arg-type]
        ref_split_step(p, g, buf, rows, True, **HP)  # type: ignore[arg-type]
        ref_other = MuonMatrix(other, go, other_buf)
        muon_step_([ref_other], nesterov=True, compute_dtype=torch.float32, **HP)  # type: ignore[arg-type]
    whole = torch.cat([m.master for m in mats], dim=1).view(32, cols)  # the parts back in group order
    assert torch.equal(whole, p)
    assert torch.equal(lone.master, other)


def test_verdict_on_the_device_steps_alike_and_a_skipped_step_changes_nothing() -> None:
    rows, cols = QkvRows(2, 8, 4), 16
    gen = torch.Generator().manual_seed(2)
    p, buf, g = _triple(gen, (32, cols))
    host = qkv_matrices(p.clone(), g.clone(), buf.clone(), rows)
    dev = qkv_matrices(p.clone(), g.clone(), buf.clone(), rows)
    skipped = qkv_matrices(p.clone(), g.clone(), buf.clone(), rows)
    kw: dict = dict(nesterov=True, compute_dtype=torch.float32, **HP)
    muon_step_(host, grad_scale=0.5, **kw)
    muon_step_(dev, grad_scale=torch.tensor(0.5), found_inf=torch.tensor(0.0), **kw)
    muon_step_(skipped, grad_scale=torch.tensor(0.5), found_inf=torch.tensor(1.0), **kw)
    for a, b in zip(host, dev):
        assert torch.equal(a.master, b.master) and torch.equal(a.momentum, b.momentum)
    base = qkv_matrices(p, g, buf, rows)
    for s, b in zip(skipped, base):
        assert torch.equal(s.master, b.master) and torch.equal(s.momentum, b.momentum) and torch.equal(s.grad, b.grad)


def test_bf16_split_step_tracks_the_fp32_one() -> None:
    gen = torch.Generator().manual_seed(3)
    rows = QkvRows(2, 32, 16)
    p, buf, g = _triple(gen, (128, 64))
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        master = p.clone()
        muon_step_(qkv_matrices(master, g.clone(), buf.clone(), rows), nesterov=True, compute_dtype=dtype,
                   **HP)  # type: ignore[arg-type]
        runs[dtype] = master - p
    d32, d16 = runs[torch.float32], runs[torch.bfloat16]
    assert float((d16 - d32).norm() / d32.norm()) <= 0.025  # test_muon_batch's bf16 tolerance


def test_stacked_blocks_must_be_one_3d_part() -> None:
    with pytest.raises(ValueError, match="one \\[G, r, n\\] part"):
        MuonMatrix(torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(8, 4), stacked=True)


# --- marking, routing, cost ---------------------------------------------------------------------------
def test_the_model_marks_qkv_weights_with_megatrons_rows() -> None:
    from moectl.core.config.load import load_config
    from trainer.build import build_model

    base = ["model.num_layers=2", "model.hidden_size=32", "moe.num_experts=4", "moe.ffn_hidden_size=16"]
    for extra, want in [(["model.num_attention_heads=4", "model.num_query_groups=2"], QkvRows(2, 16, 8)),
                        (["model.num_attention_heads=4", "model.num_query_groups=4"], QkvRows(4, 8, 8)),
                        (["model.num_attention_heads=4", "model.num_query_groups=1", "model.kv_channels=16"],
                         QkvRows(1, 64, 16))]:  # fmt: skip
        model = build_model(load_config(None, [*base, *extra]), torch.device("cpu"))
        marked = {n: qkv_rows(p) for n, p in model.named_parameters() if qkv_rows(p) is not None}
        assert marked == {f"decoder.layers.{i}.self_attention.linear_qkv.weight": want for i in range(2)}, extra
        w = model.get_parameter("decoder.layers.0.self_attention.linear_qkv.weight")
        assert w.shape[0] == want.groups * want.group_rows
    p = nn.Parameter(torch.zeros(24, 8))
    setattr(p, QKV_ROWS_ATTR, QkvRows(2, 8, 2))
    assert split_qkv_rows(p, True) == QkvRows(2, 8, 2) and split_qkv_rows(p, False) is None
    assert muon_ns_shapes(p, True, True) == [(16, 8), (4, 8), (4, 8)] and muon_ns_shapes(p, True, False) == [(24, 8)]
    setattr(p, QKV_ROWS_ATTR, (2, 8, 2))
    with pytest.raises(TypeError, match="QkvRows"):
        qkv_rows(p)


def test_cost_and_flops_count_the_parts() -> None:
    # The reference model's QKV: 4 groups of 4 heads of dim 128 into 2048: [3072, 2048] -> [2048, 2048] + 2 x
    # [512, 2048]: 18% fewer Newton-Schulz FLOPs (optimizer.muon_split_qkv's doc)
    rows = QkvRows(4, 512, 128)
    parts = qkv_split_shapes((3072, 2048), rows)
    assert parts == [(2048, 2048), (512, 2048), (512, 2048)]
    whole, split = ns_flops((3072, 2048), 5), sum(ns_flops(s, 5) for s in parts)
    assert round(1 - split / whole, 2) == 0.18
    p = nn.Parameter(torch.zeros(3072, 2048))
    setattr(p, QKV_ROWS_ATTR, rows)
    assert muon_cost(True, True)(p) == sum(ns_cost(s) for s in parts) < muon_cost(True, False)(p) == ns_cost(p.shape)


# --- the Muon + AdamW chain over a real model, and the loop ----------------------------------------------
def _qkv_of(t) -> dict[str, QkvRows | None]:  # type: ignore[no-untyped-def]
    muon = t.engine.optimizer.members[0]
    return {m.name: m.qkv for s in muon.shards for m in s.matrices if m.name.endswith("linear_qkv.weight")}


def test_trainer_steps_qkv_as_the_reference(tmp_path: Path) -> None:
    """The real loop (default on): after one step, each QKV weight is exactly `ref_split_step` of its initial
    value with the grad the step used (clipping off, so the grad is the raw one)."""
    t = trainer(tmp_path / "on", "train.train_iters=1", "optimizer.clip_grad=0.0", "model.num_attention_heads=4",
                "model.num_query_groups=2", "train.device=cpu")  # QkvRows(2, 16, 8); the host-verdict update
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    rows = _qkv_of(t)[name]
    assert rows is not None and rows == qkv_rows(t.model.get_parameter(name))
    before = t.model.get_parameter(name).detach().clone()
    grads: dict[str, torch.Tensor] = {}
    lrs: list[float] = []
    muon = t.engine.optimizer.members[0]
    original = muon._update

    def spy(lr: float, coef: float) -> None:
        for s in muon.shards:
            for m in s.matrices:
                if m.name == name:
                    grads["g"] = s.bucket.grad_data[s.lo + m.lo:s.lo + m.hi].view(m.shape).clone()
                    lrs.append(lr)
        original(lr, coef)

    muon._update = spy  # type: ignore[method-assign]
    t.run()
    cfg = t.cfg.optimizer
    ref = before.clone()
    ref_split_step(ref, grads["g"], torch.zeros_like(ref), rows, cfg.muon_nesterov, lr=lrs[0],
                   momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps, weight_decay=cfg.weight_decay)
    assert torch.equal(t.model.get_parameter(name), ref)


def test_trainer_split_on_vs_off(tmp_path: Path) -> None:
    """The option changes the QKV weights' training (only theirs on the first step: the rest are bitwise alike)."""
    runs = {}
    for split in ("true", "false"):
        t = trainer(tmp_path / split, "train.train_iters=1", f"optimizer.muon_split_qkv={split}")
        assert all((rows is not None) == (split == "true") for rows in _qkv_of(t).values()) and _qkv_of(t)
        runs[split] = (t.run().losses, {n: p.detach().clone() for n, p in t.model.named_parameters()})
    (on_losses, on), (off_losses, off) = runs["true"], runs["false"]
    assert on_losses == off_losses  # the same first forward
    for n in on:
        assert torch.equal(on[n], off[n]) != n.endswith("linear_qkv.weight"), n


# --- resuming across the option ------------------------------------------------------------------------
def test_resuming_with_another_split_than_the_checkpoint_trained_with_warns() -> None:
    """A user trial resumed a Muon checkpoint saved before this option existed (QKV whole) and got other losses
    than the old code with no word; a checkpoint that records the other value is the same case."""
    from types import SimpleNamespace

    from moectl.core.config.load import load_config
    from trainer.checkpointing.resume import warn_changed_muon_splits

    def ck(optimizer: dict) -> SimpleNamespace:
        return SimpleNamespace(meta={"config": {"optimizer": optimizer}}, path=Path("/ck/step_00000004"))

    muon = load_config(None, ["optimizer.optimizer=muon"])
    with pytest.warns(UserWarning, match=r"trained with optimizer.muon_split_qkv=false \(it was saved before the "
                                         r"option existed\); this run resumes with true.*set optimizer.muon_split_qkv"
                                         r"=false to continue as it trained"):
        warn_changed_muon_splits(ck({"optimizer": "muon", "muon_split_glu": True}), muon)  # type: ignore[arg-type]
    off = load_config(None, ["optimizer.optimizer=muon", "optimizer.muon_split_qkv=false"])
    with pytest.warns(UserWarning, match=r"muon_split_qkv=true; this run resumes with false"):
        warn_changed_muon_splits(ck({"optimizer": "muon", "muon_split_glu": True, "muon_split_qkv": True}),
                                 off)  # type: ignore[arg-type]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same options, or not a Muon run: nothing to say
        warn_changed_muon_splits(ck({"optimizer": "muon", "muon_split_glu": True, "muon_split_qkv": True}),
                                 muon)  # type: ignore[arg-type]
        warn_changed_muon_splits(ck({"optimizer": "adam"}), load_config(None, []))  # type: ignore[arg-type]
        # a model with no fused QKV weight: the split changes nothing there, so nothing is said
        warn_changed_muon_splits(ck({"optimizer": "muon", "muon_split_glu": True}), muon,  # type: ignore[arg-type]
                                 nn.Linear(4, 4))
    marked = nn.Linear(4, 4)
    setattr(marked.weight, QKV_ROWS_ATTR, QkvRows(1, 2, 1))
    with pytest.warns(UserWarning, match="muon_split_qkv=false"):
        warn_changed_muon_splits(ck({"optimizer": "muon", "muon_split_glu": True}), muon, marked)  # type: ignore[arg-type]


def test_the_loop_warns_when_it_resumes_muon_with_the_split_switched(tmp_path: Path) -> None:
    trainer(tmp_path, "train.train_iters=2", "checkpoint.save_interval=2").run()
    with pytest.warns(UserWarning, match="optimizer.muon_split_qkv=true; this run resumes with false"):
        trainer(tmp_path, "train.train_iters=3", "optimizer.muon_split_qkv=false",
                f"checkpoint.load={tmp_path / 'checkpoints'}").run()
