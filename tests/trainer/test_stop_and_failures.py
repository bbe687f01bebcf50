"""Signals, lost peers and timeouts as the loop sees them (trainer/stop.py, trainer/parallel/failures.py), and
the CPU thread rule (trainer/threads.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from dist_helpers import run_distributed
from trainer.parallel.failures import CollectiveFailure, collective_failure
from trainer.stop import REPEAT_GRACE_S, StopSignals, acknowledgement
from trainer.threads import choose_cpu_threads

GLOO_LOST = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
             "[127.0.0.1]:9947. This is typically caused by a remote worker crashing.")  # fmt: skip
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                "waiting 6000ms for recv operation to complete")  # fmt: skip


def test_backend_texts_become_one_line_failures_naming_rank_and_step() -> None:
    lost = collective_failure(RuntimeError(GLOO_LOST), rank=0, step=14, timeout_s=600)
    assert isinstance(lost, CollectiveFailure) and lost.kind == "peer-lost"
    assert lost.message.startswith("rank 0 lost a peer during step 14: another rank exited or crashed (Connection")
    assert "pair.cc" not in lost.message
    late = collective_failure(RuntimeError(GLOO_TIMEOUT), rank=1, step=None, timeout_s=6)
    assert isinstance(late, CollectiveFailure) and late.kind == "timeout"
    assert late.one_line().startswith("rank 1 timed out after 6 s waiting in a collective while starting the run")
    assert "distributed_timeout_minutes" in late.one_line()
    # Anything else is not ours to rename: a bug keeps its own exception and traceback.
    assert collective_failure(ValueError("Timed out"), rank=0, step=1, timeout_s=6) is None
    assert collective_failure(RuntimeError("shape mismatch"), rank=0, step=1, timeout_s=6) is None


def test_a_repeated_sigint_within_the_grace_is_the_launcher_forwarding_it() -> None:
    with StopSignals(repeat_grace_s=REPEAT_GRACE_S) as stop:  # a process in a terminal's session
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # a parent forwards the terminal's Ctrl-C: not an abort
        assert stop.signal == "SIGINT"
        stop._first_at -= REPEAT_GRACE_S + 1  # a deliberate second Ctrl-C, later
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_launched_worker_aborts_on_its_launchers_word_not_on_a_count_of_signals() -> None:
    """A review found a SIGINT sent to every process of the job (`scancel -s INT`, `pkill -INT`) aborting the
    run unsaved: each worker got it directly, then the launcher's forwarded copy a moment later, and a worker
    (no terminal reaches it) took any second SIGINT as a second press. A launched worker now aborts only when
    its launcher asked for it (`abort_requested`), whenever the SIGINT comes, and on one abort only."""
    asked = [False]
    with StopSignals(repeat_grace_s=0.0, abort_requested=lambda: asked[0]) as stop:
        os.kill(os.getpid(), signal.SIGINT)  # the scheduler's
        os.kill(os.getpid(), signal.SIGINT)  # the launcher forwarding its own: the same request
        time.sleep(0.1)
        assert stop.signal == "SIGINT"
        asked[0] = True  # the launcher's second Ctrl-C: it says so, then sends SIGINT on
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # a third press cannot break the clean-up
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_the_first_signal_is_acknowledged_at_once_in_one_line() -> None:
    """A step can take minutes: the handler itself says what the signal will do (once), not the step's end."""
    said: list[str] = []
    with StopSignals(announce=said.append, saves=True, repeat_grace_s=REPEAT_GRACE_S) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # within the grace: nothing more said, no abort
        assert stop.signal == "SIGTERM"
    assert said == ["received SIGTERM: stopping after the current step and saving a checkpoint"]
    assert acknowledgement("SIGINT", saves=True) == (
        "received SIGINT: stopping after the current step and saving a checkpoint (Ctrl-C again to abort without "
        "saving)")  # fmt: skip
    assert acknowledgement("SIGINT", saves=False) == (
        "received SIGINT: stopping after the current step; nothing will be saved (checkpoint.save_interval is not "
        "set; Ctrl-C again to abort at once)")  # fmt: skip

    def broken(line: str) -> None:
        raise BrokenPipeError  # stdout's reader has gone: the stop must still be recorded

    with StopSignals(announce=broken) as stop:
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.signal == "SIGHUP"


def test_the_thread_rule() -> None:
    assert choose_cpu_threads(3, env={"OMP_NUM_THREADS": "5"}).threads == 3  # the key wins
    assert choose_cpu_threads(None, env={"OMP_NUM_THREADS": "5"}).threads == 5
    assert choose_cpu_threads(None, env={"OMP_NUM_THREADS": "junk"}).threads == 1
    assert choose_cpu_threads(None, env={}).threads == 1


FAST = [
    "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=16", "moe.num_experts=4", "moe.ffn_hidden_size=16", "train.micro_batch_size=2",
    "train.global_batch_size=8", "data.source=synthetic", "train.eval_interval=null", "optimizer.lr_warmup_iters=0",
]


def _one_rank_signalled(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from moectl.core.config.load import load_config
    from trainer.loop import Trainer
    from trainer.observer import SilentObserver
    from trainer.runtime import setup_runtime

    cfg = load_config(None, [*FAST, f"run_dir={root}", "train.train_iters=8", "checkpoint.save_interval=100"])
    t = Trainer(cfg, SilentObserver(), runtime=setup_runtime(cfg.train, cfg.parallel))
    real = t.train_step

    def step(s: int) -> dict:
        out = real(s)
        if rank == 1 and s + 1 == 3:  # only rank 1 is told to stop, during step 3
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    t.train_step = step  # type: ignore[method-assign]
    with StopSignals() as stop:
        r = t.run(stop=stop)
    return {"steps": r.steps, "stopped_by": r.stopped_by, "saved": str(r.saved)}


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path: Path) -> None:
    results = run_distributed(_one_rank_signalled, world_size=2, timeout=120, root=str(tmp_path))
    assert results[0] == results[1] == {
        "steps": 3, "stopped_by": "SIGTERM", "saved": str(tmp_path / "checkpoints" / "step_00000003"),
    }
