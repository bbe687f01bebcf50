"""`optimizer.muon_split_glu`: a gated fc1 weight orthogonalised as its gate and up halves.

The reference is written here from the definition, not from the code under test: the Nesterov blend of
the whole weight, its gate rows and its up rows picked by explicit row indices (`[gate; up]`, or blocks
`[g(I), u(I), ...]` as moectl/core/facts.py states the layout), the existing single-matrix
`newton_schulz` on each `[F, in]` half of each expert alone (2-D GEMMs), the halves put back by the same
indices, decoupled weight decay and the update on the whole weight with the half's Moonlight scale
`0.2 * sqrt(max(F, in))`. Against it, CPU fp32, bitwise: the batched step (`muon_step_`), both expert
layouts, interleaved rows; the option off is today's whole-matrix step; a non-gated activation is not
split; the layer-wise plan and the FLOP count see the halves.

Shapes keep every Gram side >= 8 (batched and 2-D GEMMs then agree bitwise on CPU, see muon_batch) and
include halves taller than wide and `2F > in`, where the half's Moonlight scale differs from the whole's.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_muon import FAST, trainer  # noqa: E402

from moectl.core.facts import GLU_ROWS_ATTR, GluRows  # noqa: E402
from trainer.optim.layerwise_layout import plan_layerwise_buffer, shard_loads, shape_cost  # noqa: E402
from trainer.optim.muon import glu_split_shape, muon_update_, newton_schulz, ns_cost, ns_flops  # noqa: E402
from trainer.optim.muon_batch import MuonMatrix, batches, muon_step_  # noqa: E402
from trainer.optim.muon_routing import glu_rows, muon_cost, muon_ns_shapes, split_glu_rows  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # small GEMMs, and one thread keeps elementwise ops alike

HP = dict(lr=0.02, momentum=0.9, ns_steps=5, weight_decay=0.1)


# --- the reference ------------------------------------------------------------------------------------
def gate_up_rows(f: int, interleave: int | None) -> tuple[list[int], list[int]]:
    """The row indices of the gate and of the up half of a `[2F, in]` fc1, each in feature order."""
    if interleave is None:
        return list(range(f)), list(range(f, 2 * f))
    gate, up = [], []
    for block in range(f // interleave):
        base = block * 2 * interleave
        gate += range(base, base + interleave)
        up += range(base + interleave, base + 2 * interleave)
    return gate, up


def ref_split_step(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, interleave: int | None, nesterov: bool,
                   lr: float, momentum: float, ns_steps: int, weight_decay: float) -> None:
    """Muon on `p` (`[2F, in]` or `[E, 2F, in]`) with the gate and up halves of every slice orthogonalised alone."""
    buf.lerp_(g, 1 - momentum)
    update = torch.lerp(g, buf, momentum) if nesterov else buf
    f, n = p.size(-2) // 2, p.size(-1)
    gate, up = gate_up_rows(f, interleave)
    ortho = torch.empty_like(update)
    for e in range(p.numel() // (2 * f * n)):
        u, o = update.reshape(-1, 2 * f, n)[e], ortho.view(-1, 2 * f, n)[e]
        for rows in (gate, up):
            o[rows] = newton_schulz(u[rows], ns_steps)  # the existing single-matrix iteration, 2-D
    p.mul_(1 - lr * weight_decay)
    p.add_(ortho, alpha=-lr * 0.2 * math.sqrt(max(f, n)))


def _triple(gen: torch.Generator, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(shape, generator=gen) for _ in range(3))


# (2F, in): 2F > in with tall halves (scale sqrt(F) vs sqrt(2F)); 2F = in (the reference model's experts);
# 2F < in
FC1_SHAPES = [(48, 16), (32, 32), (32, 48)]


# --- the step against the reference -------------------------------------------------------------------
@pytest.mark.parametrize("interleave", [None, 4, 8], ids=["gate;up", "interleave4", "interleave8"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("experts", [0, 3], ids=["2-D", "grouped"])
def test_split_step_is_bitwise_the_reference(interleave: int | None, nesterov: bool, experts: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for rows, cols in FC1_SHAPES:
        shape = (experts, rows, cols) if experts else (rows, cols)
        p, buf, _ = _triple(gen, shape)
        mat = MuonMatrix(p.clone(), torch.empty(shape), buf.clone(), GluRows(interleave))
        assert mat.shape == (*shape[:-2], 2, rows // 2, cols) and mat.slices == 2 * max(experts, 1)
        for _ in range(3):
            g = torch.randn(shape, generator=gen)
            mat.grad.copy_(g)
            muon_step_([mat], nesterov=nesterov, compute_dtype=torch.float32, **HP)  # type: ignore[arg-type]
            ref_split_step(p, g, buf, interleave, nesterov, **HP)  # type: ignore[arg-type]
            assert torch.equal(mat.grad, g)  # an input only
        assert torch.equal(mat.master, p) and torch.equal(mat.momentum, buf), (shape, interleave)


def test_contiguous_halves_are_muon_of_each_half_alone() -> None:
    """With `[gate; up]` rows the split step is the existing `muon_update_` run on the gate rows and on the
    up rows as two params of their own (`[F, in]` each, contiguous)."""
    gen = torch.Generator().manual_seed(1)
    for rows, cols in FC1_SHAPES:
        p, buf, _ = _triple(gen, (rows, cols))
        mat = MuonMatrix(p.clone(), torch.empty(rows, cols), buf.clone(), GluRows())
        f = rows // 2
        for _ in range(3):
            g = torch.randn(rows, cols, generator=gen)
            mat.grad.copy_(g)
            muon_step_([mat], nesterov=True, compute_dtype=torch.float32, **HP)  # type: ignore[arg-type]
            for half in (slice(0, f), slice(f, rows)):
                muon_update_(p[half], g[half], buf[half], nesterov=True, **HP)  # type: ignore[arg-type]
        assert torch.equal(mat.master, p) and torch.equal(mat.momentum, buf), (rows, cols)


@pytest.mark.parametrize("interleave", [None, 4], ids=["gate;up", "interleave4"])
def test_grouped_and_per_expert_split_alike_in_one_batch_with_other_matrices(interleave: int | None) -> None:
    """A grouped `[E, 2F, in]` weight and E per-expert `[2F, in]` weights, split, step bitwise alike, and
    their halves join the batch of the other `[F, in]` matrices without changing anyone's bits."""
    E, rows, cols = 3, 48, 16
    f = rows // 2
    gen = torch.Generator().manual_seed(2)
    p, buf, _ = _triple(gen, (E, rows, cols))
    other, other_buf, _ = _triple(gen, (f, cols))  # an unrelated [F, in] matrix (batched with the halves)
    grouped = MuonMatrix(p.clone(), torch.empty(E, rows, cols), buf.clone(), GluRows(interleave))
    per_expert = [MuonMatrix(p[e].clone(), torch.empty(rows, cols), buf[e].clone(), GluRows(interleave))
                  for e in range(E)]
    lone = MuonMatrix(other.clone(), torch.empty(f, cols), other_buf.clone())
    lone_ref = MuonMatrix(other.clone(), torch.empty(f, cols), other_buf.clone())
    assert [len(run) for run in batches([grouped, lone, *per_expert])] == [2 + E]  # one [F, in] batch
    for _ in range(3):
        g, go = torch.randn(E, rows, cols, generator=gen), torch.randn(f, cols, generator=gen)
        grouped.grad.copy_(g)
        for e, m in enumerate(per_expert):
            m.grad.copy_(g[e])
        lone.grad.copy_(go)
        lone_ref.grad.copy_(go)
        muon_step_([grouped, lone], nesterov=True, compute_dtype=torch.float32, **HP)  # type: ignore[arg-type]
        muon_step_(per_expert, nesterov=True, compute_dtype=torch.float32, **HP)  # type: ignore[arg-type]
        muon_update_(lone_ref.master, go, lone_ref.momentum, nesterov=True, **HP)  # type: ignore[arg-type]
        ref_split_step(p, g, buf, interleave, True, **HP)  # type: ignore[arg-type]
    assert torch.equal(grouped.master, torch.stack([m.master for m in per_expert]))
    assert torch.equal(grouped.momentum, torch.stack([m.momentum for m in per_expert]))
    assert torch.equal(grouped.master, p)
    assert torch.equal(lone.master, lone_ref.master)


def test_unsplit_gated_weight_is_todays_whole_matrix_step() -> None:
    """`glu=None` (the option off) orthogonalises the `[2F, in]` weight whole, as before the option."""
    gen = torch.Generator().manual_seed(3)
    for shape in [(48, 16), (3, 32, 48)]:
        p, buf, _ = _triple(gen, shape)
        mat = MuonMatrix(p.clone(), torch.empty(shape), buf.clone())
        assert mat.shape == shape
        for _ in range(3):
            g = torch.randn(shape, generator=gen)
            mat.grad.copy_(g)
            muon_step_([mat], nesterov=True, compute_dtype=torch.float32, **HP)  # type: ignore[arg-type]
            muon_update_(p, g, buf, nesterov=True, **HP)  # type: ignore[arg-type]
        assert torch.equal(mat.master, p), shape


def test_bf16_split_step_tracks_the_fp32_one() -> None:
    gen = torch.Generator().manual_seed(4)
    p, buf, g = _triple(gen, (2, 64, 32))
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        mat = MuonMatrix(p.clone(), g.clone(), buf.clone(), GluRows(8))
        muon_step_([mat], nesterov=True, compute_dtype=dtype, **HP)  # type: ignore[arg-type]
        runs[dtype] = mat.master - p
    d32, d16 = runs[torch.float32], runs[torch.bfloat16]
    assert float((d16 - d32).norm() / d32.norm()) <= 0.025  # test_muon_batch's bf16 tolerance


def test_rows_that_are_not_gate_up_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="even number of rows"):
        glu_split_shape((7, 4))
    with pytest.raises(ValueError, match="gate/up blocks"):
        MuonMatrix(torch.zeros(12, 4), torch.zeros(12, 4), torch.zeros(12, 4), GluRows(4))  # F = 6


# --- routing, cost, plan ------------------------------------------------------------------------------
def test_the_model_marks_gated_fc1_weights_only() -> None:
    from moectl.core.config.load import load_config
    from trainer.build import build_model

    base = ["model.num_layers=2", "model.moe_layer_freq=[1,0]", "model.hidden_size=32", "model.num_attention_heads=2",
            "model.num_query_groups=1", "moe.num_experts=4", "moe.ffn_hidden_size=16"]
    for extra, experts_rows in [(["moe.glu_interleave_size=4"], GluRows(4)),
                                (["moe.single_grouped_weight=false"], GluRows()),
                                (["moe.activation=squared_relu"], None)]:
        model = build_model(load_config(None, [*base, *extra]), torch.device("cpu"))
        marked = {n: glu_rows(p) for n, p in model.named_parameters() if glu_rows(p) is not None}
        fc1 = [n for n, _ in model.named_parameters() if n.startswith("decoder.layers.0.mlp.experts.linear_fc1.weight")]
        assert len(fc1) == (4 if "moe.single_grouped_weight=false" in extra else 1)
        want = {"decoder.layers.1.mlp.linear_fc1.weight": GluRows()}  # the dense SwiGLU MLP
        if experts_rows is not None:
            want.update({n: experts_rows for n in fc1})
        assert marked == want, extra
    p = nn.Parameter(torch.zeros(3, 8, 4))
    setattr(p, GLU_ROWS_ATTR, GluRows())
    assert split_glu_rows(p, True) == GluRows() and split_glu_rows(p, False) is None
    assert muon_ns_shapes(p, True, True) == [(3, 2, 4, 4)] and muon_ns_shapes(p, False, True) == [(3, 8, 4)]
    setattr(p, GLU_ROWS_ATTR, 4)
    with pytest.raises(TypeError, match="GluRows"):
        glu_rows(p)


def test_cost_and_flops_count_the_halves() -> None:
    assert ns_cost(glu_split_shape((4, 64, 32))) == 4 * 2 * ns_cost((32, 32))
    # The reference model's experts (E 32, F 1024, D 2048): fc1 [2F, D] is square, its halves [F, D] are wide.
    whole, halves = ns_flops((32, 2048, 2048), 5), ns_flops(glu_split_shape((32, 2048, 2048)), 5)
    assert whole == 32 * 5 * 6 * 2048**3 and halves == 32 * 2 * 5 * (4 * 1024**2 * 2048 + 2 * 1024**3)
    assert whole / halves == 2.4
    p = nn.Parameter(torch.zeros(4, 32, 64))  # 2F < in: halves [16, 64] cost half the whole (64 * 32^2)
    setattr(p, GLU_ROWS_ATTR, GluRows(8))
    q = nn.Parameter(torch.zeros(4, 32, 64))  # same shape, no gate/up rows
    assert muon_cost(True)(p) == ns_cost((4, 2, 16, 64)) == ns_cost((4, 32, 64)) // 2
    assert muon_cost(True)(q) == shape_cost(q) == ns_cost((4, 32, 64))
    assert muon_cost(False)(p) == shape_cost(p)


def test_the_plan_balances_the_split_cost() -> None:
    """Ownership follows the cost Muon will pay: a gated fc1 [32, 64] costs 64 * 32^2 whole and half that
    split (halves [16, 64]). Planned with the whole cost, the split work is 1:2 over two ranks; planned
    with the split cost (what `muon_model_options` does with the option on), 1:1."""
    shapes = {"fc1": (32, 64), "a": (32, 32), "b": (16, 64), "c": (16, 64)}
    params = [nn.Parameter(torch.zeros(s)) for s in shapes.values()]
    names = dict(zip(params, shapes))
    setattr(params[0], GLU_ROWS_ATTR, GluRows())
    assert [muon_cost(False)(p) for p in params] == [65536, 32768, 16384, 16384]
    assert [muon_cost(True)(p) for p in params] == [32768, 32768, 16384, 16384]
    split = muon_cost(True)
    plans = {s: plan_layerwise_buffer(params, names, bucket_size=10**6, shard_group_size=2, cost=muon_cost(s))
             for s in (False, True)}
    assert sorted(shard_loads(plans[False], params, split)) == [32768, 65536]  # fc1 alone on one rank
    assert shard_loads(plans[True], params, split) == [49152, 49152]
    assert shard_loads(plans[False], params, muon_cost(False)) == [65536, 65536]  # what that plan balanced


# --- the Muon + AdamW chain, and the real loop ----------------------------------------------------------
@pytest.mark.parametrize("split", [False, True], ids=["off", "on"])
def test_chain_splits_marked_weights_only_when_configured(split: bool) -> None:
    """Layer-wise Muon over a toy whose expert weight `[3, 16, 16]` and input weight `[16, 8]` are marked
    gated (blocks of 4, and `[gate; up]`): on, they step as `ref_split_step`; off, as the whole-matrix
    Muon reference of test_muon, i.e. exactly as before the option (the other params alike either way)."""
    from test_muon import ONE, loss_fn, ref_muon_step, reference_chain, train_step

    from moectl.core.config.schema import OptimizerConfig, ParallelConfig
    from trainer.distributed import DistributedModel
    from trainer.optim.chained import build_muon_optimizer
    from trainer.optim.muon_routing import muon_model_options
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    from dist_toy import ToyMoE

    marks = {"experts.weight": GluRows(4), "inp.weight": GluRows()}

    def marked(model: ToyMoE) -> ToyMoE:
        for n, rows in marks.items():
            setattr(model.get_parameter(n), GLU_ROWS_ATTR, rows)
        return model

    cfg = OptimizerConfig(lr=0.02, weight_decay=0.1, muon_momentum=0.9, muon_split_glu=split, clip_grad=0.0)
    model = marked(ToyMoE())
    dm = DistributedModel(model, ParallelConfig(bucket_size=10**6), ONE, **muon_model_options(True, split))
    opt = build_muon_optimizer(dm, cfg)
    seen = {m.name: m.glu for s in opt.members[0].shards for m in s.matrices}
    assert seen == {"inp.weight": marks["inp.weight"] if split else None, "out.weight": None,
                    "experts.weight": marks["experts.weight"] if split else None}
    ref = ToyMoE()
    muon, _, adam, bufs = reference_chain(ref, cfg)
    for step in range(4):
        train_step(dm, opt, step, cfg.lr)
        ref.zero_grad()
        loss_fn(ref, step).backward()
        with torch.no_grad():
            for n, p in muon:
                if split and n in marks:
                    ref_split_step(p, p.grad, bufs[n], marks[n].interleave, True, lr=cfg.lr, momentum=0.9,
                                   ns_steps=5, weight_decay=0.1)
                else:
                    ref_muon_step(p, p.grad, bufs[n], cfg.lr, 0.9, True, 5, 0.1)
        adam.step()
    for n, q in ref.named_parameters():
        assert torch.equal(model.get_parameter(n), q), n


def _glu_of(t) -> dict[str, GluRows | None]:  # type: ignore[no-untyped-def]
    muon = t.engine.optimizer.members[0]
    return {m.name: m.glu for s in muon.shards for m in s.matrices}


@pytest.mark.parametrize("interleave", [None, 4], ids=["gate;up", "interleave4"])
def test_trainer_expert_layouts_train_bitwise_alike_split(tmp_path: Path, interleave: int | None) -> None:
    """The real loop, split on (the default), a MoE layer and a dense SwiGLU layer: single-grouped and
    per-expert experts train bitwise alike, with the gate/up blocks interleaved or not."""
    extra = ["train.train_iters=3", "model.moe_layer_freq=[1,0]", f"moe.glu_interleave_size={interleave or 'null'}"]
    grouped = trainer(tmp_path / "g", *extra, "moe.single_grouped_weight=true")
    per_expert = trainer(tmp_path / "p", *extra, "moe.single_grouped_weight=false")
    rows = GluRows(interleave)
    split = {n: g for n, g in _glu_of(per_expert).items() if g is not None}
    assert split == {**{f"decoder.layers.0.mlp.experts.linear_fc1.weight{e}": rows for e in range(4)},
                     "decoder.layers.1.mlp.linear_fc1.weight": GluRows()}
    assert _glu_of(grouped)["decoder.layers.0.mlp.experts.linear_fc1.weight"] == rows
    a, b = grouped.run(), per_expert.run()
    assert a.losses == b.losses
    pe = dict(per_expert.model.named_parameters())
    for n, p in grouped.model.named_parameters():
        other = torch.stack([pe[f"{n}{e}"] for e in range(p.shape[0])]) if ".experts." in n else pe[n]
        assert torch.equal(p, other), n


@pytest.mark.parametrize("activation", ["swiglu", "squared_relu"])
def test_trainer_split_on_vs_off(tmp_path: Path, activation: str) -> None:
    """The option changes a gated model's training and leaves a non-gated one bitwise as it was."""
    runs = {}
    for split in ("true", "false"):
        t = trainer(tmp_path / split, "train.train_iters=3", f"moe.activation={activation}",
                    f"optimizer.muon_split_glu={split}")
        assert any(g is not None for g in _glu_of(t).values()) == (split == "true" and activation == "swiglu")
        runs[split] = (t.run().losses, {n: p.detach().clone() for n, p in t.model.named_parameters()})
    (on_losses, on), (off_losses, off) = runs["true"], runs["false"]
    fc1 = "decoder.layers.0.mlp.experts.linear_fc1.weight"
    if activation == "swiglu":
        assert not torch.equal(on[fc1], off[fc1]) and on_losses[0] == off_losses[0]  # same first forward
    else:
        assert on_losses == off_losses and all(torch.equal(on[n], off[n]) for n in on)
