"""Sums of squares of final weight grads, left by the kernel that wrote them, so the grad norm need not read
those grads again.

The grad norm reads every fp32 grad once: 2.9 ms of the reference step on an H100 (`_foreach_norm` over 7.3
GB), 88% of it the expert weight grads. On the step's last micro-batch the expert wgrad kernel holds each
final grad tile in registers anyway; with `sq` it also writes the tile's sum of squares to a slot of its own
(`trainer/kernels/grouped_wgrad.py`), and the norm adds those partials instead.

That is right only while nothing changes the grads between that backward and the norm: no data-parallel
reduce and no 1/dp scale, i.e. one data-parallel rank. So:

    the loop       arms the last micro-batch's backward (`final_accumulation`) when its engine says the grads
                   are final after it (`Engine.grads_final_after_backward`)
    zero_grad      `clear()`s (`DistributedModel.zero_grad_buffer`): no record outlives its grads
    a layer        whose kernel wrote partials for some grads `record`s them (a later record of the same grads
                   replaces it; `record(grads, None)` drops it: a backward that wrote without partials)
    the optimizer  `take_covered(views)`: the records whose grads lie wholly inside the ranges it counts, and
                   the parts of those ranges no record covers, which it reads as before
    a CUDA graph   captured armed keeps what its capture recorded and records it again after each replay

A record that is never taken changes nothing; a grad without a record is read as before. Module state, as
the backward runs on autograd's device threads: one training loop per process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

_armed = False


@dataclass(frozen=True, eq=False)
class SqRecord:
    """Partial sums of squares (`partials`, any float dtype, summed in fp64) of the final `grads`."""

    grads: tuple[torch.Tensor, ...]
    partials: torch.Tensor

    @property
    def key(self) -> tuple[tuple[int, int], ...]:
        return tuple((g.data_ptr(), g.numel()) for g in self.grads)


_records: dict[tuple[tuple[int, int], ...], SqRecord] = {}


@contextlib.contextmanager
def final_accumulation(on: bool = True) -> Iterator[None]:
    """Arm (`on`) the backwards run inside: their writers' last adds leave partial sums of squares."""
    global _armed
    prev, _armed = _armed, on
    try:
        yield
    finally:
        _armed = prev


def armed() -> bool:
    """Whether a backward running now is the step's last accumulation into grads nothing changes afterwards."""
    return _armed


def record(grads: Sequence[torch.Tensor], partials: Optional[torch.Tensor]) -> None:
    """`partials` sum to the sum of squares of `grads` as they are now; None: forget any record of them."""
    rec = SqRecord(tuple(grads), partials if partials is not None else torch.empty(0))
    if partials is None:
        _records.pop(rec.key, None)
    else:
        _records[rec.key] = rec


def recorded() -> list[SqRecord]:
    """The records now (what a graph's capture made)."""
    return list(_records.values())


def restore(records: Sequence[SqRecord]) -> None:
    """Record `records` again (after the replay of the graph whose capture made them)."""
    for rec in records:
        _records[rec.key] = rec


def clear() -> None:
    """Forget every record: the grads are about to be zeroed."""
    _records.clear()


def take_covered(views: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the parts of the 1-D grad ranges `views` that no record covers, the partials of the records whose grads
    all lie inside them). Those records are taken: the next call does not see them."""
    spans = [(v.untyped_storage().data_ptr(), v.data_ptr(), v.data_ptr() + v.numel() * v.element_size(), i)
             for i, v in enumerate(views) if v.numel() and v.is_contiguous()]
    cut: dict[int, list[tuple[int, int]]] = {}
    partials: list[torch.Tensor] = []
    views_key = tuple((s, lo, hi, views[i].dtype) for s, lo, hi, i in spans)
    for key, rec in list(_records.items()):
        # grads and views keep their addresses for a run: where a record's grads lie is worked out once
        place_key = (key, views_key)
        if place_key not in _PLACES:
            if len(_PLACES) > 4096:
                _PLACES.clear()
            _PLACES[place_key] = _cuts(rec.grads, spans, views)
        cuts = _PLACES[place_key]
        if cuts is None:
            continue  # some of its grads are counted elsewhere (another optimizer, another rank)
        for i, lo, hi in cuts:
            cut.setdefault(i, []).append((lo, hi))
        partials.append(rec.partials)
        del _records[key]
    rest: list[torch.Tensor] = []
    for i, v in enumerate(views):
        at = 0
        for lo, hi in sorted(cut.get(i, [])):
            if lo > at:
                rest.append(v[at:lo])
            at = max(at, hi)
        if at < v.numel():
            rest.append(v[at:])
    return rest, partials


_PLACES: dict[tuple, Optional[list[tuple[int, int, int]]]] = {}


def _cuts(grads: Sequence[torch.Tensor], spans: list[tuple[int, int, int, int]],
          views: Sequence[torch.Tensor]) -> Optional[list[tuple[int, int, int]]]:
    """(view index, first element, end) of each of `grads` in `views`; None unless all lie inside them."""
    out = []
    for g in grads:
        i = _inside(g, spans, views)
        if i is None:
            return None
        lo = (g.data_ptr() - views[i].data_ptr()) // views[i].element_size()
        out.append((i, lo, lo + g.numel()))
    return out


def _inside(g: torch.Tensor, spans: list[tuple[int, int, int, int]], views: Sequence[torch.Tensor]) -> Optional[int]:
    """The index of the view (of `g`'s dtype) whose range holds all of contiguous `g`, or None."""
    if not g.is_contiguous():
        return None
    storage, lo = g.untyped_storage().data_ptr(), g.data_ptr()
    hi = lo + g.numel() * g.element_size()
    for s, v_lo, v_hi, i in spans:
        if s == storage and v_lo <= lo and hi <= v_hi and views[i].dtype == g.dtype:
            return i
    return None
