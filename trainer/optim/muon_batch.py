"""Muon over many matrices at once: one Newton-Schulz GEMM chain per group of same-shaped matrices.

A rank of a layer-wise Muon run owns dozens of matrices, many of one shape (every layer's QKV, every
layer's experts). Orthogonalising them one param at a time launches ~15 kernels per matrix per step,
and small matrices leave a GPU idle; `muon_step_` stacks every owned matrix of one trailing shape
`[m, n]` (2-D params as one slice, grouped `[E, m, n]` weights or runs of their expert slices as E) into
one `[B, m, n]` batch in the compute dtype and runs one batched iteration on it (`muon.orthogonalize_`).

What stays per matrix: the momentum EMA and the Nesterov blend (elementwise; the blend is written
straight into the matrix's slot of the batch, so the only copy is the cast the compute dtype needs), the
weight decay and the update with the matrix's own Moonlight scale, and the write of the new master into the
bf16 param (`MuonMatrix.publish`, in the same pass: no separate staging copy reads the master again). On
CUDA with a low-precision iteration those run as the fused kernels of `kernels/muon_triton.py`
(`fused_elementwise` says when), which also apply the clip coefficient (`grad_scale`) on the fly; elsewhere
as torch ops. Both take the clip coefficient and the non-finite flag as device tensors too (the verdict left
on the device, `layerwise.LayerWiseMuon.device_verdict`). Every op is the one `muon.muon_update_` runs on
that matrix alone, and the batched fp32 GEMMs give each slice the same bits whatever else is in the batch
(CPU, tested), so a grouped `[E, out, in]` weight and E per-expert weights stay bitwise alike.
Against the 2-D GEMMs `muon_update_` runs on a lone `[m, n]` param, batched ones are bitwise equal on
CPU except for tiny Gram matrices (min(m, n) <= 5 measured, MKL's small-GEMM path: rounding-level), so
a run that is a single 2-D matrix keeps the 2-D GEMMs and only stacked 2-D matrices (e.g. every layer's
router) take the batched ones. On CUDA a batched GEMM may use another kernel than a 2-D one: equal to
rounding, not bitwise.

A gated fc1 weight given with its row layout (`MuonMatrix.glu`, Muon's `optimizer.muon_split_glu`) is
two matrices per `[2F, n]` slice, its gate and up `[F, n]` halves (`muon.glu_split_shape`, the half's
Moonlight scale): they join the batch of every other `[F, n]` matrix (the halves of every layer's and
every expert's fc1, in either layout). With `[gate; up]` rows the halves are consecutive in memory, so the
slot is the weight's rows in order and only the count changes; with interleaved blocks the blend of the
whole weight is gathered into the slot (one copy) and the result scattered back into a whole-weight tensor
(one copy). Momentum, weight decay and update run on the whole weight either way, so each half gets the
bits the existing single-matrix iteration gives it alone (CPU, tested).

A fused QKV weight given with its row layout (`optimizer.muon_split_qkv`) is three matrices, its query, key and
value parts (`qkv_matrices`): each a `MuonMatrix` of `[G, r, n]` row-block views of the weight's tensors
(`stacked`: one part's rows of every query group), which Newton-Schulz sees as one `[G r, n]` matrix in the batch
of every other matrix of that shape (a query part `[D, D]` joins the output projections). The blend writes the
blocks into the slot in order and the update reads them back from it, in place on the weight (the fused kernels
through a table of block offsets, `kernels/block_table.py`): no copy.

A batch holds at most `MAX_BATCH_ELEMENTS` elements (a larger single matrix goes alone): the iteration
keeps about four batch-sized tensors alive (X, the Gram matrices A and B, the next X; the Gram form of a
`[m, 2m]` batch about five: six `[m, m]` matrices), and batching gains nothing once one GEMM fills the device
(2^30-element batches measured no faster on an H100, docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from moectl.core.facts import GluRows, QkvRows
from trainer.kernels import has_triton
from trainer.optim.grad_norm import clipped
from trainer.optim.muon import glu_halves, glu_split_shape, muon_lr_scale, orthogonalize_, qkv_parts
from trainer.streams import side_stream
from trainer.switches import switched_off

#: elements per Newton-Schulz batch (2^28: 512 MiB per batch-sized tensor in bf16)
MAX_BATCH_ELEMENTS = 1 << 28
OVERLAP_ENV = "MOECTL_MUON_OVERLAP"


@dataclass(frozen=True)
class MuonMatrix:
    """One unit of Muon work: an fp32 master, its grad (unclipped: `muon_step_` takes the clip coefficient)
    and momentum, all of one shape:
    `[m, n]`, or `[k, m, n]` for k expert slices. `glu`: the row layout of a gated fc1 weight to
    orthogonalise as gate and up halves (None: as it is). `publish`: where the updated master goes, cast
    (the param's range of a bf16 param buffer: the update writes it, so staging need not copy it), or None.
    `stacked`: the tensors are `[G, r, n]` row blocks of one weight (a part of a fused QKV weight,
    `qkv_matrices`) that Newton-Schulz sees stacked as one `[G r, n]` matrix."""

    master: torch.Tensor
    grad: torch.Tensor
    momentum: torch.Tensor
    glu: Optional[GluRows] = None
    publish: Optional[torch.Tensor] = None
    stacked: bool = False

    def __post_init__(self) -> None:
        if self.glu is not None:
            glu_halves(self.master, self.glu.interleave)  # refuses rows that are no gate/up blocks
        if self.stacked and (self.glu is not None or self.master.dim() != 3):
            raise ValueError(f"stacked row blocks are one [G, r, n] part, got {tuple(self.master.shape)}")
        if self.publish is not None and self.publish.shape != self.master.shape:
            raise ValueError(f"published param {tuple(self.publish.shape)} != master {tuple(self.master.shape)}")

    @property
    def shape(self) -> torch.Size:
        """What Newton-Schulz sees: the master's shape, `[*lead, 2, F, n]` for gate and up halves, `[G r, n]`
        for stacked row blocks."""
        if self.stacked:
            g, r, n = self.master.shape
            return torch.Size((g * r, n))
        return self.master.shape if self.glu is None else glu_split_shape(self.master.shape)

    @property
    def slices(self) -> int:
        """How many `[m, n]` matrices this is."""
        shape = self.shape
        return self.master.numel() // (shape[-2] * shape[-1])

    @property
    def gathers(self) -> bool:
        """Whether the batch slot is not the master's rows in order (interleaved gate/up blocks)."""
        return self.glu is not None and self.glu.interleave is not None


def qkv_matrices(master: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, rows: QkvRows,
                 publish: Optional[torch.Tensor] = None) -> list[MuonMatrix]:
    """The query, key and value parts of a fused QKV weight's tensors (`[G (q + 2 kv), n]` each, Megatron's
    per-group rows) as three stacked `MuonMatrix` (`muon.qkv_parts`): Muon orthogonalises each part alone."""
    parts = [qkv_parts(t, rows) for t in (master, grad, momentum)]
    published = qkv_parts(publish, rows) if publish is not None else [None] * 3
    return [MuonMatrix(m, g, b, publish=p, stacked=True) for m, g, b, p in zip(*parts, published)]


def batches(matrices: Sequence[MuonMatrix], max_elements: int = MAX_BATCH_ELEMENTS) -> Iterator[list[MuonMatrix]]:
    """Matrices grouped by trailing shape (groups in order of first appearance, members in the order given),
    each group cut into consecutive runs of at most `max_elements` elements (a larger matrix alone)."""
    groups: dict[tuple[int, int], list[MuonMatrix]] = {}
    for m in matrices:
        groups.setdefault(tuple(m.shape[-2:]), []).append(m)  # type: ignore[arg-type]
    for members in groups.values():
        run: list[MuonMatrix] = []
        held = 0
        for m in members:
            if run and held + m.master.numel() > max_elements:
                yield run
                run, held = [], 0
            run.append(m)
            held += m.master.numel()
        yield run


def _kernels() -> Any:
    from trainer.kernels import muon_triton  # imports Triton: CUDA only, on first use

    return muon_triton


def fused_elementwise(run: Sequence[MuonMatrix], compute_dtype: torch.dtype) -> bool:
    """Whether `run`'s elementwise work goes through `kernels/muon_triton` (CUDA with Triton, a low-precision
    iteration, no gathered gate/up halves, tensors contiguous or stacked row blocks, whose slices tile into the
    kernels' blocks)."""
    if compute_dtype == torch.float32 or run[0].master.device.type != "cuda" or not has_triton():
        return False
    kernels = _kernels()
    for mat in run:
        if mat.gathers or not kernels.fits(mat.shape[-2] * mat.shape[-1]):
            return False
        tensors = (mat.master, mat.grad, mat.momentum) + ((mat.publish,) if mat.publish is not None else ())
        if not all(kernels.takes(t) for t in tensors):  # contiguous, or stacked row blocks of whole blocks
            return False
    return True


@torch.no_grad()
def muon_step_(matrices: Sequence[MuonMatrix], *, lr: float, momentum: float, nesterov: bool, ns_steps: int,
               weight_decay: float, compute_dtype: torch.dtype, grad_scale: float | torch.Tensor = 1.0,
               found_inf: Optional[torch.Tensor] = None, max_batch_elements: int = MAX_BATCH_ELEMENTS,
               ns_method: str = "standard") -> None:
    """One Muon step in place on every matrix's master and momentum.

    `grad_scale`: the clip coefficient the grads are multiplied by first (`grad_norm.clipped`: in place on
    the torch path with a host verdict; the fused kernels, and the torch path with a device verdict, leave
    the grads as they were).

    The verdict may stay on the device (`grad_norm.GradVerdict`, so the host queues the step before it knows
    the norm): `grad_scale` an fp32 scalar tensor, `found_inf` an fp32 scalar that, when 1, leaves every
    master, momentum, grad and published param as it was (the iteration still runs). The fused kernels read
    both in place; the torch path computes out of place and keeps the old values where the flag is set.

    On CUDA the batches form a pipeline over two streams: while batch i's Newton-Schulz GEMMs run on the
    current stream, a side stream applies batch i-1's update and blends batch i+1 (memory-bound work under
    compute-bound GEMMs). Every kernel sees the same inputs as in sequence, so the bits are the same;
    `MOECTL_MUON_OVERLAP=0` runs the batches in sequence. `ns_method`: `optimizer.muon_ns_method`, resolved per
    batch (`muon.uses_gram`).
    """
    step = _Step(lr, momentum, nesterov, weight_decay, compute_dtype, grad_scale, found_inf)
    runs = list(batches(matrices, max_batch_elements))
    if not runs:
        return
    if not _overlaps(runs):
        for run in runs:
            X, sumsq, fused = step.prepare(run)
            step.apply(run, orthogonalize_(X, ns_steps, sumsq, ns_method), fused)
        return
    main = torch.cuda.current_stream()
    side = side_stream(main.device, "muon")
    side.wait_stream(main)  # the grads, momenta and masters as the step found them

    def prepare_on_side(run: list[MuonMatrix]) -> tuple[torch.Tensor, Optional[torch.Tensor], bool, torch.cuda.Event]:
        with torch.cuda.stream(side):
            X, sumsq, fused = step.prepare(run)
            ready = side.record_event()
        for t in (X, sumsq):  # made on the side stream, used on the main one: not reused before main is done
            if t is not None:
                t.record_stream(main)
        return X, sumsq, fused, ready

    nxt = prepare_on_side(runs[0])
    for i, run in enumerate(runs):
        X, sumsq, fused, ready = nxt
        main.wait_event(ready)
        O = orthogonalize_(X, ns_steps, sumsq, ns_method)
        done = main.record_event()
        O.record_stream(side)
        if i + 1 < len(runs):
            nxt = prepare_on_side(runs[i + 1])  # queued on the side stream ahead of this batch's apply
        with torch.cuda.stream(side):
            side.wait_event(done)
            step.apply(run, O, fused)
        del X, sumsq, O
    main.wait_stream(side)  # the masters are read next (bf16 publish, param gather)


def _overlaps(runs: list[list[MuonMatrix]]) -> bool:
    """Whether the batches run as the two-stream pipeline: on CUDA, more than one batch, not switched off."""
    return (len(runs) > 1 and runs[0][0].master.device.type == "cuda"
            and not switched_off(OVERLAP_ENV))  # fmt: skip


@dataclass(frozen=True)
class _Step:
    """The elementwise hyperparameters of one Muon step, and its per-batch work before and after Newton-Schulz."""

    lr: float
    momentum: float
    nesterov: bool
    weight_decay: float
    compute_dtype: torch.dtype
    grad_scale: float | torch.Tensor
    found_inf: Optional[torch.Tensor] = None

    def prepare(self, run: list[MuonMatrix]) -> tuple[torch.Tensor, Optional[torch.Tensor], bool]:
        """Momentum EMA and Nesterov blend of every matrix of `run` into one new batch X; returns (X, each
        slice's sum of squares where the fused kernels computed them, whether they ran)."""
        m, n = run[0].shape[-2:]
        # A lone 2-D matrix stays 2-D: exactly `muon_update_`'s GEMMs (see the module docstring).
        batch = (m, n) if len(run) == 1 and len(run[0].shape) == 2 else (sum(mat.slices for mat in run), m, n)
        X = torch.empty(batch, dtype=self.compute_dtype, device=run[0].master.device)
        fused = fused_elementwise(run, self.compute_dtype)
        partials = None  # per-block sums of squares of the blends (fused path)
        if fused:
            partials = torch.empty(X.numel() // _kernels().BLOCK, dtype=torch.float32, device=X.device)
        at = 0
        for mat in run:
            slot = X if X.dim() == 2 else X[at:at + mat.slices]
            if fused:
                _kernels().blend_(mat.grad, mat.momentum, slot, partials, at * (m * n) // _kernels().BLOCK,
                                  coef=self.grad_scale, beta=self.momentum, nesterov=self.nesterov,
                                  skip=self.found_inf)  # fmt: skip
            else:
                _blend(mat, slot, self.grad_scale, self.momentum, self.nesterov, self.found_inf)
            at += mat.slices
        sumsq = None if partials is None else _kernels().slice_sums(partials, m * n)
        return X, sumsq, fused

    def apply(self, run: list[MuonMatrix], O: torch.Tensor, fused: bool) -> None:
        """Weight decay and the scaled orthogonalised update `O` (the batch's result) of every matrix of `run`."""
        decay = 1 - self.lr * self.weight_decay
        at = 0
        for mat in run:
            ortho = O if O.dim() == 2 else O[at:at + mat.slices]
            at += mat.slices
            alpha = -self.lr * muon_lr_scale(mat.shape)
            if fused:
                _kernels().apply_(mat.master, ortho, decay=decay, alpha=alpha, publish=mat.publish,
                                  skip=self.found_inf)
                continue
            if mat.gathers:  # scatter the halves back into the weight's row order
                whole = torch.empty(mat.master.shape, dtype=ortho.dtype, device=ortho.device)
                halves = glu_halves(whole, mat.glu.interleave)  # type: ignore[union-attr]
                halves.copy_(ortho.unflatten(-2, halves.shape[-3:-1]).reshape(halves.shape))
                ortho = whole
            else:
                ortho = ortho.reshape(mat.master.shape)  # a view, maybe transposed
            if self.found_inf is None:
                if self.weight_decay != 0:
                    mat.master.mul_(decay)
                mat.master.add_(ortho, alpha=alpha)
                if mat.publish is not None:
                    mat.publish.copy_(mat.master)
                continue
            # the verdict on the device: the same operations out of place, kept where the flag is 0
            new = mat.master.mul(decay) if self.weight_decay != 0 else mat.master.clone()
            new.add_(ortho, alpha=alpha)
            skip = self.found_inf != 0  # where() writes into the kept tensor: no third full-size temporary
            if mat.publish is not None:
                torch.where(skip, mat.publish, new.to(mat.publish.dtype), out=mat.publish)
            torch.where(skip, mat.master, new, out=mat.master)


def _blend(mat: MuonMatrix, slot: torch.Tensor, grad_scale: float | torch.Tensor, momentum: float, nesterov: bool,
           skip: Optional[torch.Tensor] = None) -> None:
    """The torch path of the momentum EMA and the Nesterov blend, written into the matrix's batch slot.

    With the verdict on the device (`grad_scale` a tensor, or a `skip` flag) nothing is written in place but
    the slot until the new momentum is kept where the flag is 0; the grad is left unscaled, as the fused path
    leaves it. The same operations either way, so the same bits."""
    if skip is None and not isinstance(grad_scale, torch.Tensor):
        grad = clipped(mat.grad, grad_scale)
        buf = mat.momentum.lerp_(grad, 1 - momentum)
    else:
        grad = torch.mul(mat.grad.float(), grad_scale)  # a new fp32 tensor: the grad is not scaled in place
        buf = torch.lerp(mat.momentum, grad, 1 - momentum)
    if mat.gathers:  # the blend of the whole weight, its gate and up blocks gathered into the slot
        update = torch.lerp(grad, buf, momentum) if nesterov else buf
        halves = glu_halves(update, mat.glu.interleave)  # type: ignore[union-attr]
        slot.view(halves.shape).copy_(halves)
    elif nesterov:  # computed in fp32, one cast on store
        torch.lerp(grad, buf, momentum, out=slot.view(mat.master.shape))
    else:
        slot.view(mat.master.shape).copy_(buf)
    if buf is not mat.momentum:
        if skip is None:
            mat.momentum.copy_(buf)
        else:
            torch.where(skip != 0, mat.momentum, buf, out=mat.momentum)
