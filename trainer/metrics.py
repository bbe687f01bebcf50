"""What a run records: `metrics.jsonl`, optional TensorBoard (the live display is the observer's).

`metrics.jsonl` holds one JSON object per line. Python's json writes floats with `repr`, i.e. the
shortest string that round-trips, so losses compare bit for bit across runs (docs/interface.md).
Only rank 0 writes or prints.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from moectl.core.errors import MoectlError


def truncate_after(path: Path, step: int) -> int:
    """Keep the records of `path` up to `step` (train and eval), drop the rest; returns how many were dropped.

    A resumed run continues from its checkpoint's step; records after it were written by the run that
    stopped or crashed after that checkpoint, and appending to them would hold those steps twice. A line
    that does not parse (a record torn by a crash) is dropped too. The file is replaced atomically.
    """
    kept, dropped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


class MetricsWriter:
    """Appends train and eval records to `run_dir/metrics.jsonl` (and TensorBoard when enabled).

    `resume_at` > 0: the run resumes after that step; the file keeps its records up to it and is appended
    to (`dropped` counts the later ones removed), and TensorBoard purges its later events.
    """

    def __init__(self, run_dir: Path, *, jsonl: bool = True, tensorboard: bool = False, resume_at: int = 0) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.dropped = 0
        self._file = None
        self._whole = 0
        if jsonl:
            try:
                if resume_at and self.path.is_file():
                    self.dropped = truncate_after(self.path, resume_at)
                self._file = open(self.path, "a" if resume_at else "w", encoding="utf-8")
                self._whole = self._file.tell()  # the size up to the last whole record
            except OSError as e:
                raise MoectlError(
                    f"{self.path}: cannot write the run's metrics there ({e.strerror or e})",
                    "make it a writable file (or move it away), or train into another --run-dir",
                ) from None
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is an optional extra
                raise MoectlError(
                    f"logging.tensorboard is on but TensorBoard is not importable ({e})",
                    "pip install 'moectl[tensorboard]' or set logging.tensorboard=false",
                ) from None
            # purge_step: events after the resumed step came from the run that stopped, as above
            self._tb = SummaryWriter(str(run_dir / "tb"), purge_step=resume_at + 1 if resume_at else None)

    def write(self, record: dict[str, Any]) -> None:
        """Write one record; `step` is required."""
        if self._file is not None:
            try:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
                self._whole = self._file.tell()
            except OSError as e:  # a full disk, a quota: the run stops here, its last checkpoint intact
                with contextlib.suppress(OSError):
                    self._file.close()  # closes the descriptor even when the flush of the rest fails again
                with contextlib.suppress(OSError):
                    os.truncate(self.path, self._whole)  # no half record (truncating frees space: it fits)
                self._file = None
                raise MoectlError(
                    f"{self.path}: cannot write the run's metrics ({e.strerror or e})",
                    "free space on (or fix) run_dir's filesystem, then resume with checkpoint.load",
                ) from None
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
