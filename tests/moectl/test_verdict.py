"""The launcher's one line and exit code for a run (moectl/cli/verdict.py), from rank reports and exit codes."""

from __future__ import annotations

from moectl.cli import outcome as O
from moectl.cli.verdict import Exit, aborted_line, verdict

CKPT = "runs/x/checkpoints/step_00000010"


def o(rank: int, kind: str, code: int, step: int | None = 14, message: str = "", **kw) -> O.Outcome:
    return O.Outcome(rank=rank, kind=kind, exit_code=code, step=step, message=message, **kw)


def test_all_finished_is_0_and_silent() -> None:
    v = verdict(2, {0: o(0, O.FINISHED, 0), 1: o(1, O.FINISHED, 0)}, {})
    assert (v.code, v.line) == (0, None)


def test_all_stopped_takes_their_code_and_stays_silent() -> None:
    stopped = {r: o(r, O.STOPPED, 3, signal="SIGTERM") for r in range(2)}
    assert (verdict(2, stopped, {0: Exit(3)}).code, verdict(2, stopped, {}).line) == (3, None)
    unsaved = {r: o(r, O.STOPPED, 143, signal="SIGTERM") for r in range(2)}
    assert verdict(2, unsaved, {}, launcher_signal="SIGTERM").code == 143


def test_a_killed_rank_is_named_with_its_signal_the_step_and_the_checkpoint() -> None:
    lost = o(0, O.PEER_LOST, 1, message="rank 0 lost a peer during step 14: ...", checkpoint=CKPT)
    v = verdict(2, {0: lost}, {1: Exit(-9, "SIGKILL"), 0: Exit(1)})
    assert v.code == 1
    assert v.line == ("rank 1 was killed by SIGKILL during step 14 (rank 0 lost it in a collective). "
                      f"fix: resume from {CKPT} with --set checkpoint.load=runs/x/checkpoints")


def test_ranks_that_all_ended_unreported_name_the_first_to_end_and_the_marked_checkpoint() -> None:
    """A device-tool trial on two GPUs: rank 1 SIGKILLed, rank 0 waited for it in NCCL (no Python handler runs
    there), never reported, and torchrun killed it 30 s later. The line named rank 0, "before the first step",
    and no checkpoint, though step 3's had committed."""
    killed = {1: Exit(-9, "SIGKILL", at=1000.0), 0: Exit(-9, "SIGKILL", at=1030.0)}
    v = verdict(2, {}, killed, saves=True, started={0, 1}, checkpoint=CKPT)
    assert (v.code, v.line) == (1, "rank 1 was killed by SIGKILL during training; then rank 0 was killed by SIGKILL. "
                                   f"fix: resume from {CKPT} with --set checkpoint.load=runs/x/checkpoints")
    # a review: torchrun's times are whole seconds; within one, the order torchrun found them ended decides
    at_once = {1: Exit(-9, "SIGKILL", at=1000.0), 0: Exit(-15, "SIGTERM", at=1000.0)}
    v = verdict(2, {}, at_once, saves=True)
    assert v.line == ("rank 1 was killed by SIGKILL before the first step; rank 0 was killed by SIGTERM. fix: no "
                      "checkpoint was saved before it ended; run it again")
    four = {1: Exit(-9, "SIGKILL", at=1000.0), 2: Exit(-9, "SIGKILL", at=1000.0), 0: Exit(-9, "SIGKILL", at=1030.0),
            3: Exit(-9, "SIGKILL", at=1030.0), 4: Exit(1, at=1030.0)}  # fmt: skip
    assert verdict(5, {}, four, started={0}).line.startswith(
        "rank 1 was killed by SIGKILL during training; so did rank 2; then ranks 0, 3 were killed by SIGKILL; then "
        "rank 4 exited with code 1 without a report. fix:")
    # NCCL's watchdog SIGABRTs the rank that waited; the hung one is killed later: the line says it may be so
    hung = {0: Exit(-6, "SIGABRT", at=1000.0), 1: Exit(-9, "SIGKILL", at=1030.0)}
    assert verdict(2, {}, hung, started={0, 1}).line.startswith(
        "rank 0 was killed by SIGABRT during training; then rank 1 was killed by SIGKILL; a SIGABRT is also how "
        "NCCL's watchdog ends a rank whose collective timed out, so the ranks that ended later may have hung. fix:")
    unknown = {1: Exit(-9, "SIGKILL", at=1000.0), 0: Exit(-9, "SIGKILL")}  # a time only where torchrun gave one
    line = verdict(2, {}, unknown, started={0}).line
    assert line is not None and line.startswith(
        "rank 1 was killed by SIGKILL during training; then rank 0 was killed by SIGKILL. fix: nothing was saved")


def test_a_hung_rank_is_named_as_hung() -> None:
    timed_out = o(0, O.TIMEOUT, 1, message="rank 0 timed out ...", timeout_s=6.0)
    v = verdict(2, {0: timed_out}, {0: Exit(1), 1: Exit(-9, "SIGKILL")})
    assert v.line is not None and v.line.startswith(
        "rank 1 hung during step 14: rank 0 timed out after 6 s waiting for it in a collective, then it was killed "
        "by SIGKILL. fix: nothing was saved"
    )


def test_a_ranks_own_error_wins_over_the_others_lost_peers() -> None:
    own = o(1, O.ERROR, 2, step=None, message="train.device='cuda' but no CUDA device is visible. fix: set it")
    v = verdict(2, {0: o(0, O.PEER_FAILED, 1, step=None, message="stopping"), 1: own}, {})
    assert (v.code, v.line) == (2, f"rank 1, before the first step: {own.message}")
    same = o(0, O.ERROR, 1, message="non-finite loss at step 14. fix: lower lr")
    v = verdict(2, {0: same, 1: o(1, O.ERROR, 1, message=same.message)}, {})
    assert v.line == f"ranks 0, 1, step 14: {same.message}"


def test_only_lost_peers_reports_the_first() -> None:
    v = verdict(2, {r: o(r, O.TIMEOUT, 1, message=f"rank {r} timed out. fix: x") for r in range(2)}, {})
    assert v.code == 1 and v.line == "rank 0 timed out. fix: nothing was saved (set checkpoint.save_interval to make a run resumable)"


def test_a_rank_killed_after_the_shutdown_timeout_is_named() -> None:
    v = verdict(2, {0: o(0, O.STOPPED, 3, checkpoint=CKPT)}, {1: Exit(-9, "SIGKILL")}, launcher_signal="SIGTERM")
    assert v.code == 1 and v.line is not None
    assert v.line.startswith("rank 1 did not stop within the shutdown timeout after SIGTERM and was killed by SIGKILL")


def test_a_crash_on_one_rank_is_named_with_its_exception() -> None:
    crash = o(1, O.CRASH, 1, message="ValueError: shapes do not match")
    v = verdict(2, {0: o(0, O.PEER_LOST, 1, message="rank 0 lost a peer"), 1: crash}, {1: Exit(1), 0: Exit(1)})
    assert (v.code, v.line) == (1, "rank 1, step 14: ValueError: shapes do not match")


def test_the_launchers_signal_during_start_up_is_a_stop_not_a_failure() -> None:
    """A user trial: SIGTERM 2-4 s after `--nproc-per-node 2` started ended both ranks before either reported;
    the verdict said "rank 0 did not stop within the shutdown timeout" (0.5 s after the signal) and exit 1, a
    crash to a scheduler. Asked to stop during start-up and stopped: 128 + N, nothing trained or saved."""
    for sig, code in (("SIGTERM", 143), ("SIGINT", 130), ("SIGHUP", 129)):
        v = verdict(2, {}, {}, launcher_signal=sig)
        assert v.code == code
        assert v.line == f"stopped by {sig} during start-up, before the first step: nothing was trained or saved"
    early = {0: o(0, O.STOPPED, 143, step=None, signal="SIGTERM")}  # one rank had time to report, one did not
    assert verdict(2, early, {}, launcher_signal="SIGTERM").code == 143
    assert verdict(2, {}, {}).code == 1  # no signal from the launcher: ranks that vanished did fail
    # a run that had begun a step (hung at step 5000, say) and was then signalled and killed reports nothing
    # either: its start marks keep it a failure, named as before
    v = verdict(2, {}, {}, launcher_signal="SIGTERM", started={0, 1})
    assert v.code == 1 and v.line is not None and v.line.startswith("rank 0 did not stop within the shutdown timeout")


def test_a_launched_rank_marks_the_start_of_its_first_step(tmp_path, monkeypatch) -> None:
    from moectl.cli.train import _start_marking_state

    monkeypatch.setenv(O.OUTCOME_DIR_ENV, str(tmp_path))
    state = _start_marking_state(1)
    state.checkpoint = None
    assert O.read_started(tmp_path) == set()
    state.step = 1
    state.step = 2
    assert O.read_started(tmp_path) == {1} and [p.name for p in tmp_path.iterdir()] == ["started1"]


def test_the_fix_of_a_run_that_ended_unsaved_follows_its_config() -> None:
    """With checkpoint.save_interval set, "set checkpoint.save_interval" was wrong advice (the same trial)."""
    stopped = {0: o(0, O.STOPPED, 143, step=1)}
    v = verdict(2, stopped, {1: Exit(-9, "SIGKILL")}, launcher_signal="SIGINT", saves=True)
    assert v.code == 1 and v.line is not None
    assert v.line.endswith("fix: no checkpoint was saved before it ended; run it again")
    v = verdict(2, stopped, {1: Exit(-9, "SIGKILL")}, launcher_signal="SIGINT")
    assert v.line is not None and v.line.endswith("fix: nothing was saved (set checkpoint.save_interval to make a "
                                                  "run resumable)")


def test_a_run_a_second_ctrl_c_aborted_is_130_naming_the_last_good_checkpoint() -> None:
    """Ranks abort a moment apart: one may see the other gone first. The abort is the cause, not a lost peer."""
    aborted = {0: o(0, O.ABORTED, 130, step=15, checkpoint=CKPT, signal="SIGINT"),
               1: o(1, O.PEER_LOST, 1, step=15, message="rank 1 lost a peer during step 15")}  # fmt: skip
    v = verdict(2, aborted, {}, launcher_signal="SIGINT", saves=True)
    assert (v.code, v.line) == (130, f"aborted by a second Ctrl-C during step 15, without saving; the last good "
                                     f"checkpoint is {CKPT}: resume with --set checkpoint.load=runs/x/checkpoints")
    v = verdict(2, {r: o(r, O.ABORTED, 130, step=2) for r in range(2)}, {}, launcher_signal="SIGINT", saves=True)
    assert (v.code, v.line) == (130, "aborted by a second Ctrl-C during step 2, without saving; no checkpoint was "
                                     "saved")
    assert aborted_line(None, None, saves=False) == ("aborted by a second Ctrl-C before the first step, without "
                                                     "saving; nothing was saved (checkpoint.save_interval is not set)")


def test_a_launched_rank_leaves_its_pid_until_it_reports(tmp_path, monkeypatch) -> None:
    """The launcher forwards a second Ctrl-C to these pids; a rank that reported is ending, and is left alone."""
    import os

    monkeypatch.setenv(O.OUTCOME_DIR_ENV, str(tmp_path))
    O.mark_pid(1)
    assert O.read_pids(tmp_path) == {1: os.getpid()}
    O.write_outcome(o(1, O.ABORTED, 130))
    assert O.read_pids(tmp_path) == {}


def test_ranks_killed_for_an_abort_are_the_abort_naming_the_marked_checkpoint() -> None:
    """On two GPUs a second Ctrl-C left both ranks waiting in CUDA/NCCL, where no Python handler runs; after
    torchrun's 30 s the line was "rank 0 did not stop within the shutdown timeout ... no checkpoint was saved",
    exit 1, with step 40's checkpoint on disk. Killed by the launcher for the abort, they are the abort: 130."""
    killed = {0: Exit(-9, "SIGKILL"), 1: Exit(-9, "SIGKILL")}
    ckpt = "runs/x/checkpoints/step_00000040"
    v = verdict(2, {}, killed, launcher_signal="SIGINT", saves=True, started={0, 1}, aborted=True, checkpoint=ckpt)
    assert (v.code, v.line) == (130, "aborted by a second Ctrl-C, without saving; the last good checkpoint is "
                                     f"{ckpt}: resume with --set checkpoint.load=runs/x/checkpoints")
    # one rank reported its abort: its step and checkpoint come first
    v = verdict(2, {0: o(0, O.ABORTED, 130, step=41, checkpoint=CKPT)}, killed, launcher_signal="SIGINT",
                saves=True, started={0, 1}, aborted=True, checkpoint=ckpt)  # fmt: skip
    assert v.code == 130 and v.line is not None and v.line.startswith("aborted by a second Ctrl-C during step 41")
    assert CKPT in v.line
    # asked to abort after every rank had stopped and saved: the save stands
    stopped = {r: o(r, O.STOPPED, 3, signal="SIGINT", checkpoint=CKPT) for r in range(2)}
    assert verdict(2, stopped, {}, launcher_signal="SIGINT", saves=True, aborted=True).code == 3
    # killed before any step began and nothing committed
    v = verdict(2, {}, killed, launcher_signal="SIGINT", saves=True, aborted=True)
    assert v.line == "aborted by a second Ctrl-C before the first step, without saving; no checkpoint was saved"


def test_rank_0_marks_each_newer_checkpoint_for_the_launcher(tmp_path, monkeypatch) -> None:
    from pathlib import Path

    from moectl.cli.train import _start_marking_state

    monkeypatch.setenv(O.OUTCOME_DIR_ENV, str(tmp_path))
    other = _start_marking_state(1, Path("runs/x/checkpoints"))
    other.checkpoint = Path("runs/x/checkpoints/step_00000001")
    assert O.read_checkpoint(tmp_path) is None and O.read_checkpoint_root(tmp_path) is None  # rank 0's word only
    state = _start_marking_state(0, Path("runs/x/checkpoints"))
    assert O.read_checkpoint_root(tmp_path) == "runs/x/checkpoints"
    state.checkpoint = None
    assert O.read_checkpoint(tmp_path) is None
    for step in (1, 2):
        state.checkpoint = Path(f"runs/x/checkpoints/step_0000000{step}")
        assert O.read_checkpoint(tmp_path) == f"runs/x/checkpoints/step_0000000{step}"
