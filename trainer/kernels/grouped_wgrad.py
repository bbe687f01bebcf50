"""Expert weight grads accumulated into fp32 targets: the Triton kernel on CUDA, its definition elsewhere.

    targets[e] += a[rows of e]^T @ b[rows of e]   (fp32 products, never rounded to the operands' dtype)

`targets` are E fp32 `[M, N]` tensors (views of a grouped param's main_grad, or the per-expert params' own
main_grads); rows are grouped by expert, `tokens_per_expert_E[e]` each.

`stale_E` (optional): each target's int32 one-element flag, nonzero when the target holds leftovers that read
as zero (`zero_grad` skipped filling it, `trainer/main_grad.py`). A flagged target is overwritten, not added
to: on CUDA inside the kernel, which then neither zero-fills nor reads the grad; every flag is cleared after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from trainer.kernels import has_triton
from trainer.kernels.stale_zero import clear_flags_, settle_stale_


def grouped_wgrad_reference_(targets: Sequence[torch.Tensor], a_TM: torch.Tensor, b_TN: torch.Tensor,
                             tokens_per_expert_E: torch.Tensor,
                             stale_E: Sequence[torch.Tensor] | None = None) -> None:
    """The definition, expert by expert in fp32 (the CPU path and the tests' reference)."""
    if stale_E is not None:
        settle_stale_(targets, stale_E)
    start = 0
    for target, n in zip(targets, tokens_per_expert_E.tolist()):
        if n:
            target.addmm_(a_TM[start:start + n].t().float(), b_TN[start:start + n].float())
        start += n


Source = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # (a, b, tokens per expert, offs)


def accumulate_grouped_wgrad_(targets: Sequence[torch.Tensor], a_TM: torch.Tensor, b_TN: torch.Tensor,
                              tokens_per_expert_E: torch.Tensor, offs_E: torch.Tensor | None = None,
                              stale_E: Sequence[torch.Tensor] | None = None,
                              sq: bool = False, earlier: Sequence[Source] = ()) -> torch.Tensor | None:
    """targets[e] += a[rows of e]^T b[rows of e]; one Triton launch on CUDA (no host sync), else the reference.

    `offs_E`: the cumulative row ends, if the caller has them on the device already. On Hopper, when the targets
    are whole rows of one fp32 matrix (a grouped main_grad, or per-expert main_grads laid out row-aligned in the
    grad buffer), the TMA kernel runs; otherwise the pointer kernel (the same sums, bitwise, for one source;
    with `earlier`, see below).
    `sq`: also return partial sums of squares of the targets after the add (a 1-D tensor whose sum is the
    targets' sum of squares: per tile, from the kernel's registers, on CUDA; per target, in fp64, on the CPU),
    what the grad norm reads instead of the targets (`trainer/grad_sq.py`). Else None.
    `earlier`: `(a, b, tokens_per_expert, offs)` of earlier micro-batches whose products were deferred to this
    call (`moe.defer_expert_wgrad`), added first, in order. The TMA kernel sums up to `MAX_SOURCES` of them in
    one fp32 accumulator, so the targets are read and written once per launch instead of once per micro-batch;
    elsewhere they take one launch each (the sums of separate calls).
    """
    sources = [*earlier, (a_TM, b_TN, tokens_per_expert_E, offs_E)]
    if not (a_TM.is_cuda and has_triton()):
        for i, (a, b, counts, _) in enumerate(sources):
            grouped_wgrad_reference_(targets, a, b, counts, stale_E if i == 0 else None)
        return torch.stack([t.double().square().sum() for t in targets]) if sq else None
    from trainer.kernels import grouped_wgrad_triton as kernels  # lazy: needs Triton

    base = targets[0]
    M, N = base.shape
    layout = _checked_layout(targets)
    stale = None
    if stale_E is not None:
        stale = _flag_offsets(stale_E)
        if stale is None:  # flags the kernel cannot address: settle them the slow way
            settle_stale_(targets, stale_E)
    ready = []
    for a, b, counts, offs in sources:
        if offs is None:
            offs = torch.cumsum(counts.to(a.device), 0)
        ready.append((a.contiguous(), b.contiguous(), offs))
    partials = torch.empty(kernels.sq_slots(len(targets), M, N), dtype=torch.float32, device=base.device) if sq else None
    if layout.rows is not None and all(_tma_fits(a, b, M, N) for a, b, _ in ready):
        step = kernels.MAX_SOURCES
        launches = [ready[i:i + step] for i in range(0, len(ready), step)]
        for i, launch in enumerate(launches):
            (a, b, offs), more = launch[0], launch[1:]
            last = i == len(launches) - 1
            kernels.grouped_wgrad_accumulate_tma_(*_rows_view(targets, layout), a, b, offs, M, N,
                                                  stale=stale if i == 0 else None, sq=partials if last else None,
                                                  more=more)
            if i == 0 and stale is not None:
                clear_flags_(stale_E)  # type: ignore[arg-type]
    else:
        for i, (a, b, offs) in enumerate(ready):
            last = i == len(ready) - 1
            kernels.grouped_wgrad_accumulate_(base, layout.offsets, a, b, offs, M, N,
                                              stale=stale if i == 0 else None, sq=partials if last else None)
            if i == 0 and stale is not None:
                clear_flags_(stale_E)  # type: ignore[arg-type]
    return partials


_FLAG_OFFSETS: dict[tuple[int, ...], torch.Tensor] = {}


def _flag_offsets(stale_E: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the first flag, each flag's int32-element offset from it on the device), what the kernels take; None
    where the flags are not int32 views of one allocation. Made once per set of flag addresses."""
    first = stale_E[0]
    if any(f.dtype != torch.int32 or f.device != first.device for f in stale_E) or not in_one_allocation(stale_E):
        return None
    ptrs = tuple(f.data_ptr() for f in stale_E)
    if ptrs not in _FLAG_OFFSETS:
        offsets = [(p - ptrs[0]) // 4 for p in ptrs]
        _FLAG_OFFSETS[ptrs] = torch.tensor(offsets, dtype=torch.int64).to(first.device)
    return first, _FLAG_OFFSETS[ptrs]


def rows_view(targets: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The E fp32 `[M, N]` targets as one `[R, N]` matrix and each one's first row in it (int64, on the device),
    what the TMA kernels write through; None where they are not whole rows of one allocation (or not on CUDA)."""
    layout = _checked_layout(targets)
    return None if layout.rows is None else _rows_view(targets, layout)


def _checked_layout(targets: Sequence[torch.Tensor]) -> "_Layout":
    """`_layout_of` the targets, after checking they are contiguous fp32 `[M, N]` matrices of one shape."""
    M, N = targets[0].shape
    for t in targets:
        if t.dtype != torch.float32 or tuple(t.shape) != (M, N) or t.stride() != (N, 1):
            raise ValueError("grouped wgrad targets must be contiguous fp32 [M, N] matrices of one shape")
    return _layout_of(targets)


def _rows_view(targets: Sequence[torch.Tensor], layout: "_Layout") -> tuple[torch.Tensor, torch.Tensor]:
    """The `[R, N]` matrix over row-aligned targets (`layout.rows` set) and each one's first row."""
    assert layout.rows is not None
    N = targets[0].shape[1]
    # built per call, never cached: a cached view would keep a freed grad buffer's storage alive
    return targets[layout.low].as_strided((layout.num_rows, N), (N, 1)), layout.rows


@dataclass(frozen=True)
class _Layout:
    """Where the E target matrices are, as the kernels take them (device tensors of a few int64s, no views)."""

    offsets: torch.Tensor  # [E]: element offset of each target from targets[0] (the pointer kernel)
    rows: torch.Tensor | None  # [E]: each target's first row in an [R, N] matrix (TMA); None: not row-aligned
    low: int = 0  # the target that starts that matrix (the lowest address)
    num_rows: int = 0  # R


_LAYOUTS: dict[tuple[int, ...], _Layout] = {}


def _layout_of(targets: Sequence[torch.Tensor]) -> _Layout:
    """The targets' layout, made once per set of addresses, storages and shape (main_grad views keep their
    addresses for the whole run, so nothing is copied to the device after the first call)."""
    M, N = targets[0].shape
    ptrs = tuple(t.data_ptr() for t in targets)
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in targets}
    key = (M, N, *ptrs, *sorted(storages))
    if key not in _LAYOUTS:
        dev = targets[0].device
        offsets = torch.tensor([(p - ptrs[0]) // 4 for p in ptrs], dtype=torch.int64).to(dev)
        aligned = row_aligned(ptrs, M, N) if dev.type == "cuda" else None
        if aligned is not None and not in_one_allocation(targets):
            aligned = None
        if aligned is None:
            _LAYOUTS[key] = _Layout(offsets, None)
        else:
            low, first_rows = aligned
            rows = torch.tensor(first_rows, dtype=torch.int64).to(dev)
            _LAYOUTS[key] = _Layout(offsets, rows, low, max(first_rows) + M)
    return _LAYOUTS[key]


def in_one_allocation(targets: Sequence[torch.Tensor]) -> bool:
    """Whether the targets are views of one storage that holds their whole span: what one `[R, N]` view over
    them needs. Targets that merely sit back to back in separate allocations (the caching allocator places
    them so) must not get one: the view would reach past its own storage."""
    storage = targets[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in targets):
        return False
    end = max(t.data_ptr() + t.numel() * t.element_size() for t in targets)
    return end <= storage.data_ptr() + storage.nbytes()


def row_aligned(ptrs: Sequence[int], M: int, N: int, elem_size: int = 4) -> tuple[int, list[int]] | None:
    """Whether fp32 `[M, N]` matrices at byte addresses `ptrs` are whole rows of one `[R, N]` matrix that starts
    at the lowest of them, 16-byte aligned (what one TMA descriptor needs): `(index of the lowest, first row of
    each)`, else None. Overlapping matrices are refused too (two experts would share grad rows)."""
    low = min(range(len(ptrs)), key=lambda i: ptrs[i])
    first = ptrs[low]
    if first % 16 or (N * elem_size) % 16 or any((p - first) % (N * elem_size) for p in ptrs):
        return None
    rows = [(p - first) // (N * elem_size) for p in ptrs]
    ordered = sorted(rows)
    if any(b - a < M for a, b in zip(ordered, ordered[1:])):
        return None
    return low, rows


def _tma_fits(a_TM: torch.Tensor, b_TN: torch.Tensor, M: int, N: int) -> bool:
    """Whether the TMA kernel takes these operands: Hopper or later, whole 128-row tiles of each expert's grad
    (a tile never spans two experts' rows), 16-byte aligned rows and bases."""
    from trainer.kernels.grouped_wgrad_triton import TMA_BLOCK_M, tma_supported

    row_bytes = (M * a_TM.element_size(), N * b_TN.element_size())
    return (
        tma_supported(a_TM.device)
        and M % TMA_BLOCK_M == 0
        and all(b % 16 == 0 for b in row_bytes)
        and a_TM.data_ptr() % 16 == 0
        and b_TN.data_ptr() % 16 == 0
    )
