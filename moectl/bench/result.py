"""What a bench run returns when its table is rows of dicts: the rows, notes, and what they were measured on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RowsResult:
    """`meta` (device, versions, model), one dict per row, and notes printed under the table."""

    meta: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "rows": self.rows, "notes": self.notes}
