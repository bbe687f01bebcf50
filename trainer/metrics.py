"""What a run records: `metrics.jsonl`, optional TensorBoard (the live display is the observer's).

`metrics.jsonl` holds one JSON object per line. Python's json writes floats with `repr`, i.e. the
shortest string that round-trips, so losses compare bit for bit across runs (docs/interface.md).
Only rank 0 writes or prints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moectl.core.errors import MoectlError


class MetricsWriter:
    """Appends train and eval records to `run_dir/metrics.jsonl` (and TensorBoard when enabled)."""

    def __init__(self, run_dir: Path, *, jsonl: bool = True, tensorboard: bool = False, resume: bool = False) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a" if resume else "w") if jsonl else None
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is an optional extra
                raise MoectlError(
                    f"logging.tensorboard is on but TensorBoard is not importable ({e})",
                    "pip install 'moectl[tensorboard]' or set logging.tensorboard=false",
                ) from None
            self._tb = SummaryWriter(str(run_dir / "tb"))

    def write(self, record: dict[str, Any]) -> None:
        """Write one record; `step` is required."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def expert_balance(tokens_per_expert: list[list[int]]) -> float:
    """Load imbalance over MoE layers: mean over layers of max(tokens) / mean(tokens); 1.0 is perfect."""
    ratios = []
    for counts in tokens_per_expert:
        total = sum(counts)
        if total:
            ratios.append(max(counts) / (total / len(counts)))
    return sum(ratios) / len(ratios) if ratios else 1.0
