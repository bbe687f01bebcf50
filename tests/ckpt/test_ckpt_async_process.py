"""A background save as a real process meets it: killed with SIGKILL in the middle of the write, and stopped by
SIGTERM while the writer is still busy (`python -m moectl train`, this checkout first on PYTHONPATH)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckpt import list_committed, list_uncommitted, verify_checkpoint
from ckpt.faults import SLOW_S
from moectl.core.config.load import load_config
from trainer.loop import Trainer
from trainer.observer import SilentObserver
from cli_helpers import TINY, cli_env

pytestmark = pytest.mark.slow

SETS = [
    "model.num_layers=1", "model.seq_length=32", "data.source=synthetic", "optimizer.lr_warmup_iters=1",
    "train.eval_interval=null", "train.cpu_threads=1",
]  # fmt: skip


def _train(run_dir: Path, *sets: str) -> list[str]:
    return [sys.executable, "-m", "moectl", "train", TINY, "--run-dir", str(run_dir),
            *[a for s in [*SETS, *sets] for a in ("--set", s)]]  # fmt: skip


def _wait_until(cond, p: subprocess.Popen, what: str, deadline_s: float = 120) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + deadline_s
    while not cond():
        assert p.poll() is None, f"the run ended before {what}: {p.communicate()}"
        assert time.monotonic() < end, f"no {what} within {deadline_s} s"
        time.sleep(0.05)


def _state(t: Trainer) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": v.clone() for n, e in t.engine.logical_state().items() for k, v in e.items()}


def test_sigkill_during_a_background_write_leaves_the_previous_checkpoint_latest_and_resumable(tmp_path: Path) -> None:
    run = tmp_path / "killed"
    root = run / "checkpoints"
    # The save of step 4 writes its first file, then its writer stalls; training goes on meanwhile.
    p = subprocess.Popen(_train(run, "train.train_iters=8", "checkpoint.save_interval=2"),
                         env=cli_env(MOECTL_CKPT_FAIL="0:write:stall@4"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)  # fmt: skip
    try:
        def mid_write() -> bool:
            partial = [d for d in list_uncommitted(root) if d.name.startswith("step_00000004.tmp-")]
            return bool(partial) and any(partial[0].iterdir())

        _wait_until(mid_write, p, "a half-written step 4")
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
    finally:
        p.kill()
    assert p.returncode == -signal.SIGKILL
    (partial,) = list_uncommitted(root)
    assert not (partial / "manifest.json").exists()
    assert (root / "latest").read_text() == "step_00000002\n"
    assert list_committed(root) == [root / "step_00000002"] and verify_checkpoint(root / "step_00000002") == []
    # Resumed from it, the run is the uninterrupted run, bit for bit (losses and final state).
    straight = Trainer(load_config(TINY, [*SETS, f"run_dir={tmp_path / 'straight'}", "train.train_iters=4"]),
                       SilentObserver())  # fmt: skip
    full = straight.run()
    resumed = Trainer(load_config(TINY, [*SETS, f"run_dir={run}", "train.train_iters=4", f"checkpoint.load={root}"]),
                      SilentObserver())  # fmt: skip
    assert resumed.run().losses == full.losses[2:]
    a, b = _state(straight), _state(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not partial.exists()  # the resumed run removed the interrupted save's folder


def test_sigterm_waits_for_the_writer_and_exits_3(tmp_path: Path) -> None:
    # Every save's writer takes SLOW_S more before its vote: a run that left without waiting would lose it.
    p = subprocess.Popen(_train(tmp_path, "train.train_iters=2000", "checkpoint.save_interval=1000"),
                         env=cli_env(MOECTL_CKPT_FAIL="0:finalize:slow"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        def trained_3() -> bool:
            path = tmp_path / "metrics.jsonl"
            return path.is_file() and len(path.read_text().splitlines()) >= 3

        _wait_until(trained_3, p, "3 steps")
        sent = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
        took = time.monotonic() - sent
    finally:
        p.kill()
    assert p.returncode == 3, (out[-2000:], err)
    assert err == "" and took >= SLOW_S, (err, took)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = [r["step"] for r in records if "loss" in r][-1]
    saved = tmp_path / "checkpoints" / f"step_{last:08d}"
    assert (tmp_path / "checkpoints" / "latest").read_text() == f"{saved.name}\n" and verify_checkpoint(saved) == []
    (rec,) = [r for r in records if "checkpoint" in r]
    assert rec["step"] == last and rec["save_mode"] == "background" and rec["save_background_s"] >= SLOW_S
    assert f"SIGTERM: stopped cleanly after step {last}; resume with --set checkpoint.load=" in out
    assert f"saved {saved}: training blocked" in out
