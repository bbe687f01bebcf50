"""Muon's step with a gated fc1 weight orthogonalised as its gate and up halves (`MuonMatrix.glu`).

The reference is written here from the definition, not from the code under test: the Nesterov blend of
the whole weight, its gate rows and its up rows picked by explicit row indices (`[gate; up]`, or blocks
`[g(I), u(I), ...]` as moectl/core/facts.py states the layout), the existing single-matrix
`newton_schulz` on each `[F, in]` half of each expert alone (2-D GEMMs), the halves put back by the same
indices, decoupled weight decay and the update on the whole weight with the half's Moonlight scale
`0.2 * sqrt(max(F, in))`. Against it, CPU fp32, bitwise: the batched step (`muon_step_`), both expert
layouts, interleaved rows; without `glu` the step is today's whole-matrix one.

Shapes keep every Gram side >= 8 (batched and 2-D GEMMs then agree bitwise on CPU, see muon_batch) and
include halves taller than wide and `2F > in`, where the half's Moonlight scale differs from the whole's.
"""

from __future__ import annotations

import math

import pytest
import torch

from moectl.core.facts import GluRows
from trainer.optim.muon import glu_split_shape, muon_update_, newton_schulz
from trainer.optim.muon_batch import MuonMatrix, batches, muon_step_

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
