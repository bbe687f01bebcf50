"""The block tables of Muon's fused kernels (trainer/kernels/block_table.py), on the CPU: read block by block
through its table, a row-block view gives exactly its own elements in its own order (what the kernels write
into the Newton-Schulz batch slot, and read the update back from)."""

from __future__ import annotations

import pytest
import torch

from moectl.core.facts import QkvRows
from trainer.kernels.block_table import block_table, same_layout, takes
from trainer.optim.muon import qkv_parts


def _through_table(view: torch.Tensor, block: int) -> torch.Tensor:
    """`view`'s elements as a kernel reads them: block b of the result from `block` elements of the storage at
    the table's offset b, counted from the view's first element."""
    table = block_table(view, block)
    flat = view.as_strided((view.untyped_storage().nbytes() // view.element_size() - view.storage_offset(),), (1,))
    if table is None:
        return flat[: view.numel()]
    return torch.cat([flat[int(t) * block:(int(t) + 1) * block] for t in table])


@pytest.mark.parametrize("rows,n,block", [(QkvRows(4, 8, 2), 16, 32), (QkvRows(2, 4, 4), 8, 8), (QkvRows(1, 6, 2), 4, 8)])
def test_the_qkv_parts_read_through_their_tables_are_the_parts(rows: QkvRows, n: int, block: int) -> None:
    w = torch.arange(rows.groups * rows.group_rows * n, dtype=torch.float32).view(-1, n)
    for part in qkv_parts(w, rows):
        assert takes(part, block) == ((part.shape[-2] * n) % block == 0)
        if takes(part, block):
            assert torch.equal(_through_table(part, block), part.reshape(-1)), (rows, part.shape)
    assert block_table(w, block) is None and torch.equal(_through_table(w, block), w.reshape(-1))


def test_layouts_that_are_not_whole_row_blocks_are_refused() -> None:
    w = torch.zeros(4, 6, 8)
    assert not takes(w[:, :, :4], 8)  # rows cut short: not contiguous rows
    assert not takes(w[:, 1:4], 16)  # 3 x 8 rows per group: not whole 16-element blocks
    assert not takes(w.view(24, 8)[::2], 8)  # a 2-D strided view
    with pytest.raises(ValueError, match="whole-block row-block views"):
        block_table(w[:, :, :4], 8)
    same_layout("apply", w[:, :2], torch.zeros(4, 6, 8)[:, 2:4])  # one table serves both
    with pytest.raises(ValueError, match="is not laid out as"):
        same_layout("apply", w[:, :2], torch.zeros(4, 2, 8))
