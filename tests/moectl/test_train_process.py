"""`moectl train` as a scheduler runs it: real processes, real signals, exit codes and what lands in the log.

Issue 18's Done-when, each against the installed command (`python -m moectl`, this checkout first on
PYTHONPATH so the launcher's workers import it too):
- 20 two-rank runs in a row all exit 0. Each is the smallest run that still takes the whole exit path: 2
  steps of a 1-layer model on synthetic data, with an evaluation and a checkpoint at the last step. The
  failure it guards against (a rank aborting with "terminate called without an active exception" after
  "done", 6 of 26 runs) came from the gloo group being torn down at interpreter exit, after the loop:
  what is alive then (the group, its threads and sockets, the launcher's agent) does not depend on how
  many steps ran, and a run this short spends its time in exactly the start-up and teardown under test.
- A rank killed with SIGKILL: exit 1 and one line naming the rank, the step and the checkpoint to resume.
- SIGTERM to the job's process group (what Slurm and Ctrl-C do): the ranks agree, save, exit 3, no traceback.
- A stopped (SIGSTOP) rank: reported as hung after `parallel.distributed_timeout_minutes`.
- The README's multi-node command on one machine: two torchrun agents (c10d rendezvous on 127.0.0.1, one
  process each) train to the same losses as one agent with two processes; both exit 0.
- Piped to a file: one plain line per `train.log_interval` steps, and nothing wrapped.
- One process stopped by SIGTERM: 3 after a save, 143 (128 + 15) and a warning with nothing saved.
- A second Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it) aborts both ranks at
  once: exit 130, one line naming the last good checkpoint, `latest` unchanged; one process likewise.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from ckpt import list_committed, verify_checkpoint
from cli_helpers import TINY, cli_env
from trainer.stop import REPEAT_GRACE_S

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

# CPU processes on a GPU host too; `MOECTL_TEST_TRAIN_DEVICE=cuda` runs the same tests on a GPU host's GPUs,
# where a rank waiting in CUDA or NCCL runs no Python handler (gloo fails such waits at once).
DEVICE = os.environ.get("MOECTL_TEST_TRAIN_DEVICE", "cpu")
SMALL = [
    "model.num_layers=1", "model.seq_length=32", "data.source=synthetic", "optimizer.lr_warmup_iters=1",
    "train.eval_interval=null", "train.eval_iters=1", f"train.device={DEVICE}",
]  # fmt: skip


def _sets(*items: str) -> list[str]:
    return [a for s in [*SMALL, *items] for a in ("--set", s)]


def _train(run_dir: Path, *sets: str, nproc: int = 2) -> list[str]:
    cmd = [sys.executable, "-m", "moectl", "train", TINY, "--run-dir", str(run_dir), *_sets(*sets)]
    return cmd + (["--nproc-per-node", str(nproc)] if nproc > 1 else [])


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def _wait_for_steps(p: subprocess.Popen, run_dir: Path, n: int, deadline_s: float = 120) -> None:
    _wait_for(lambda: len([r for r in _records(run_dir) if "loss" in r]) >= n, p, "the run made no progress",
              deadline_s)  # fmt: skip


def _wait_for(ready: Callable[[], bool], p: subprocess.Popen, what: str, deadline_s: float = 120) -> None:
    end = time.monotonic() + deadline_s
    while not ready():
        assert p.poll() is None, f"the run ended early: {p.communicate()}"
        assert time.monotonic() < end, what
        time.sleep(0.05)


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of the launcher's worker of global rank `rank` (a child process with RANK=rank)."""
    for child in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
        if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            return int(child)
    raise AssertionError(f"no worker of rank {rank}")


def _end(p: subprocess.Popen) -> None:
    """A run the test leaves alive (a wait that failed): its whole process group killed."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def test_twenty_two_rank_runs_in_a_row_all_exit_0(tmp_path: Path) -> None:
    for i in range(20):
        run_dir = tmp_path / f"r{i}"
        cmd = _train(run_dir, "train.train_iters=2", "train.eval_interval=2", "checkpoint.save_interval=2")
        out = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"run {i}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        assert "done: 2 steps" in out.stdout, out.stdout
        assert out.stderr == "", f"run {i}: {out.stderr[-3000:]}"
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"


def test_a_killed_rank_is_one_line_naming_the_rank_the_step_and_the_checkpoint(tmp_path: Path) -> None:
    p = subprocess.Popen(_train(tmp_path, "train.train_iters=2000", "checkpoint.save_interval=3"), env=cli_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _wait_for_steps(p, tmp_path, 4)
        # step 3's save runs in the background: the line can name a checkpoint only once one has committed
        _wait_for(lambda: (tmp_path / "checkpoints" / "latest").exists(), p, "no checkpoint committed")
        os.kill(_rank_pid(p, 1), signal.SIGKILL)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 1, (out[-2000:], err)
    (line,) = _error_lines(err)
    done = len([r for r in _records(tmp_path) if "loss" in r])
    if DEVICE == "cpu":  # rank 0 lost it in the step after its last record, or after writing it (in the stop vote)
        assert any(line.startswith(f"error: rank 1 was killed by SIGKILL during step {s} (rank 0 lost it in a "
                                   "collective)") for s in (done, done + 1)), (line, done)  # fmt: skip
    else:  # rank 0 waits in NCCL, runs no handler and is killed after torchrun's shutdown timeout, unreported (or,
        # outside that wait, takes the SIGTERM and reports): rank 1 is named first either way, not yet run on GPUs
        assert line.startswith("error: rank 1 was killed by SIGKILL during "), line
    saved = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert line.endswith(f"fix: resume from {tmp_path / 'checkpoints' / saved} with --set "
                         f"checkpoint.load={tmp_path / 'checkpoints'}"), line  # fmt: skip
    assert "Traceback" not in out + err


def test_sigterm_to_the_job_saves_on_both_ranks_and_exits_3(tmp_path: Path) -> None:
    p = subprocess.Popen(_train(tmp_path, "train.train_iters=2000", "checkpoint.save_interval=1000"), env=cli_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        _wait_for_steps(p, tmp_path, 3)
        os.killpg(p.pid, signal.SIGTERM)  # the launcher and both ranks, as Slurm's scancel or a Ctrl-C does
        out, err = p.communicate(timeout=120)
    finally:
        _end(p)
    assert p.returncode == 3, (out[-2000:], err)
    assert err == "", err  # no traceback, no torchrun log lines
    steps = [r["step"] for r in _records(tmp_path) if "loss" in r]
    last = steps[-1]
    assert steps == list(range(1, last + 1))
    saved = tmp_path / "checkpoints" / f"step_{last:08d}"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == saved.name
    assert verify_checkpoint(saved) == []
    assert f"SIGTERM: stopped cleanly after step {last}; resume with --set checkpoint.load=" in out
    assert f"stopped by SIGTERM: {last} steps" in out
    # said as the signal came, by rank 0 only
    assert out.splitlines().count("received SIGTERM: stopping after the current step and saving a checkpoint") == 1


def test_a_stopped_rank_is_reported_as_hung(tmp_path: Path) -> None:
    # A 6 s collective timeout; once rank 0 has failed, torchrun's agent waits its fixed 30 s for the stopped
    # worker to take SIGTERM before it sends SIGKILL (most of this test's time).
    cmd = _train(tmp_path, "train.train_iters=2000", "parallel.distributed_timeout_minutes=0.1")
    p = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = None
    try:
        _wait_for_steps(p, tmp_path, 3)
        victim = _rank_pid(p, 1)
        os.kill(victim, signal.SIGSTOP)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert p.returncode == 1, (out[-2000:], err)
    (line,) = _error_lines(err)
    assert "error: rank 1 hung during step " in line, line
    assert "rank 0 timed out after 6 s waiting for it in a collective" in line, line
    assert "nothing was saved" in line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_train_like_one_agent_with_two_processes(tmp_path: Path) -> None:
    """The README's multi-node command, both "nodes" on this machine (c10d rendezvous on 127.0.0.1)."""
    sets = _sets("train.train_iters=4", "train.eval_interval=2")
    port = _free_port()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "moectl-test",
             "-m", "moectl", "train", TINY, "--run-dir", str(tmp_path / "two_nodes"), *sets],
            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    try:
        outs = [a.communicate(timeout=300) for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], outs
    one = subprocess.run(_train(tmp_path / "one_node", "train.train_iters=4", "train.eval_interval=2"),
                         env=cli_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert one.returncode == 0, one.stderr
    two, single = _records(tmp_path / "two_nodes"), _records(tmp_path / "one_node")
    assert [r["step"] for r in two] == [1, 2, 2, 3, 4, 4]
    for key in ("loss", "eval_loss", "grad_norm"):
        assert [r.get(key) for r in two] == [r.get(key) for r in single], key  # the same floats


def test_piped_to_a_file_one_plain_line_per_log_interval_none_wrapped(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    cmd = _train(tmp_path / "run", "train.train_iters=6", "train.log_interval=2", "optimizer.lr_warmup_iters=10",
                 "train.eval_interval=3", nproc=1)  # fmt: skip
    with open(log, "w") as f:  # a file, as a cluster job's log: not a terminal
        rc = subprocess.run(cmd, env=cli_env(), stdout=f, stderr=subprocess.STDOUT, timeout=300).returncode
    assert rc == 0
    lines = log.read_text().splitlines()
    steps = [line for line in lines if line.startswith("step ") and "| loss " in line]
    assert [line.split(" | ")[0] for line in steps] == ["step 2/6", "step 4/6", "step 6/6"]
    for line in steps:
        fields = line.split(" | ")
        mfu = ["MFU"] if DEVICE != "cpu" else []  # a GPU run knows its peak FLOP/s
        assert [f.split(" ")[0] for f in fields] == ["step", "loss", "lr", "grad", fields[4].split(" ")[0], *mfu,
                                                      "elapsed", "ETA"], line  # fmt: skip
        assert fields[4].endswith(" tok/s")
    assert [line for line in lines if "eval loss" in line][0].startswith("step 3/6 | eval loss ")
    # Nothing wrapped: the banner's first line, the data line and the warning table's row are each whole.
    where = "cpu" if DEVICE == "cpu" else "cuda:0"
    assert any(line.startswith("moectl train 1 layers") and line.endswith(f"on {where} x1") for line in lines), lines
    assert any(line.startswith("  data: synthetic/train") and f"run_dir {tmp_path / 'run'}" in line for line in lines)
    row = [line for line in lines if "MOE015" in line]
    assert row and "make optimizer.lr_warmup_iters smaller than train.train_iters (a few percent of it is usual)" in row[0]
    assert all("…" not in line for line in lines)


@pytest.mark.parametrize(
    "sig, save, code",
    [(signal.SIGTERM, True, 3), (signal.SIGTERM, False, 128 + signal.SIGTERM),
     (signal.SIGHUP, True, 3)],  # a closed terminal: killed at once with nothing saved, before SIGHUP was handled
    ids=["sigterm-save", "sigterm-nothing-saved", "sighup-save"],
)  # fmt: skip
def test_one_process_stopped_by_a_signal_exits_with_the_documented_code(tmp_path: Path, sig: signal.Signals,
                                                                       save: bool, code: int) -> None:  # fmt: skip
    extra = ["checkpoint.save_interval=1000"] if save else []
    p = subprocess.Popen(_train(tmp_path, "train.train_iters=2000", *extra, nproc=1), env=cli_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _wait_for_steps(p, tmp_path, 2)
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == code, (out[-2000:], err)
    assert "Traceback" not in err
    name = signal.Signals(sig).name
    if save:
        assert f"{name}: stopped cleanly after step" in out and (tmp_path / "checkpoints" / "latest").is_file()
        assert verify_checkpoint(tmp_path / "checkpoints") == []
        assert f"received {name}: stopping after the current step and saving a checkpoint" in out.splitlines()
    else:
        assert f"warning: {name}: stopped after step" in out and "with nothing saved" in out
        assert (f"received {name}: stopping after the current step; nothing will be saved (checkpoint.save_interval "
                "is not set)") in out.splitlines()  # fmt: skip


def test_a_run_dir_refused_on_rank_0_stops_both_ranks_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "in_the_way").write_text("x")
    out = subprocess.run(_train(tmp_path / "in_the_way", "train.train_iters=3"), env=cli_env(), capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert _error_lines(out.stderr) == [
        f"error: rank 0, before the first step: run_dir {tmp_path / 'in_the_way'} cannot be created: a file is in "
        "the way. fix: remove that file, or choose another --run-dir (or set run_dir in the config)"
    ]


@pytest.mark.parametrize("both", [False, True], ids=["stdout", "stdout-and-stderr"])
def test_a_run_piped_into_a_reader_that_leaves_finishes(tmp_path: Path, both: bool) -> None:
    """`moectl train ... | head` (and `2>&1 | head`): the reader leaves after a few lines; the run goes on to its
    last step and exits 0 (it died with exit code 1 and nothing said, mid-run)."""
    p = subprocess.Popen(_train(tmp_path, "train.train_iters=40", "train.log_interval=1", nproc=1), env=cli_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT if both else subprocess.DEVNULL)  # fmt: skip
    assert p.stdout is not None
    try:
        p.stdout.read(300)
        p.stdout.close()  # as head does after its lines
        code = p.wait(timeout=120)
    finally:
        p.kill()
    assert code == 0
    assert [r["step"] for r in _records(tmp_path) if "loss" in r] == list(range(1, 41))


ACK_SAVING = ("received SIGINT: stopping after the current step and saving a checkpoint (Ctrl-C again to abort "
              "without saving)")  # fmt: skip


def _start_logged(cmd: list[str], out: Path, *, env: dict[str, str] | None = None,
                  own_session: bool = True) -> subprocess.Popen:
    """`cmd` with stdout to the file `out` (read while it runs) and stderr piped. `own_session`: in a process
    group of its own, so that `os.killpg(p.pid, ...)` is what a terminal's Ctrl-C sends to a foreground job."""
    with open(out, "w") as f:
        return subprocess.Popen(cmd, env=env or cli_env(), stdout=f, stderr=subprocess.PIPE, text=True,
                                start_new_session=own_session)  # fmt: skip


def _printed(out: Path, line: str) -> bool:
    return out.is_file() and line in out.read_text().splitlines()


def _assert_aborted_naming_last(err: str, run_dir: Path, recorded: int) -> str:
    """The abort's one line names `latest`, a step before the aborted one (whose save may be cut), as the last
    good checkpoint to resume from; returns its name. `recorded`: the steps recorded before the second press."""
    ckpts = run_dir / "checkpoints"
    last = (ckpts / "latest").read_text().strip()
    assert last in (f"step_{recorded:08d}", f"step_{recorded - 1:08d}"), (last, recorded)
    assert _error_lines(err) == [
        f"error: aborted by a second Ctrl-C during step {recorded + 1}, without saving; the last good checkpoint "
        f"is {ckpts / last}: resume with --set checkpoint.load={ckpts}"
    ], err
    return last


def test_a_second_ctrl_c_aborts_both_ranks_at_once_keeping_the_last_checkpoint(tmp_path: Path) -> None:
    """A user trial: under --nproc-per-node 2 the second Ctrl-C was lost (the launcher's agent sent the workers
    SIGTERM instead); the step ran on, saved a new checkpoint, and the run exited 3. Each step here takes seconds
    (4096 micro-batches a rank), so both presses land in one step, after a checkpoint has committed; the second
    comes `REPEAT_GRACE_S` after the first (sooner, it is the same request, as a forwarding parent sends it)."""
    run_dir, out = tmp_path / "run", tmp_path / "out.log"
    cmd = _train(run_dir, "train.train_iters=2000", "checkpoint.save_interval=1", "train.global_batch_size=32768")
    p = _start_logged(cmd, out)
    try:
        _wait_for(lambda: (run_dir / "checkpoints" / "latest").exists(), p, "no checkpoint committed", 180)
        os.killpg(p.pid, signal.SIGINT)  # a terminal's Ctrl-C: the launcher's group (each worker has its own)
        first = time.monotonic()
        _wait_for(lambda: _printed(out, ACK_SAVING), p, "the first Ctrl-C was not acknowledged during the step")
        recorded = len([r for r in _records(run_dir) if "loss" in r])
        time.sleep(max(0.0, first + REPEAT_GRACE_S + 0.3 - time.monotonic()))
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        _end(p)
    assert p.returncode == 130, (out.read_text()[-2000:], err)
    last = _assert_aborted_naming_last(err, run_dir, recorded)
    ckpts = run_dir / "checkpoints"
    # at once: the aborted step never ended (no time bound: a loaded CI machine may take long to tear down)
    assert [r["step"] for r in _records(run_dir) if "loss" in r] == list(range(1, recorded + 1))
    assert [c.name for c in list_committed(ckpts)][-1] == last and verify_checkpoint(ckpts) == []
    assert out.read_text().splitlines().count(ACK_SAVING) == 1  # rank 0 only, once


def test_a_second_ctrl_c_during_the_stop_save_aborts_with_nothing_committed(tmp_path: Path) -> None:
    """The first Ctrl-C's save never gets to commit (`MOECTL_CKPT_FAIL`: rank 0 stalls before the manifest); a
    second Ctrl-C while the ranks wait for it ends the run at once, with no checkpoint and no `latest`."""
    run_dir, out = tmp_path / "run", tmp_path / "out.log"
    cmd = _train(run_dir, "train.train_iters=2000", "checkpoint.save_interval=1000")
    p = _start_logged(cmd, out, env=cli_env(MOECTL_CKPT_FAIL="0:before_manifest:stall"))
    try:
        _wait_for_steps(p, run_dir, 2)
        os.killpg(p.pid, signal.SIGINT)
        _wait_for(lambda: "; saving a checkpoint first; Ctrl-C again aborts without saving" in out.read_text(), p,
                  "the run did not start its stop save")  # fmt: skip
        time.sleep(REPEAT_GRACE_S + 0.5)  # into the stalled commit, and past the same-request grace
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        _end(p)
    assert p.returncode == 130, (out.read_text()[-2000:], err)
    (line,) = _error_lines(err)
    assert line.startswith("error: aborted by a second Ctrl-C during step ") and line.endswith(
        ", without saving; no checkpoint was saved"), line  # fmt: skip
    assert not (run_dir / "checkpoints" / "latest").exists() and list_committed(run_dir / "checkpoints") == []


def test_one_process_aborted_by_a_second_ctrl_c_names_its_last_checkpoint(tmp_path: Path) -> None:
    """One process in a terminal's session (not its own): a second press more than `REPEAT_GRACE_S` after the
    first aborts, as before; the line now names the checkpoint committed in the background during the step (it
    said nothing of it: the save had not been reported yet)."""
    run_dir, out = tmp_path / "run", tmp_path / "out.log"
    cmd = _train(run_dir, "train.train_iters=2000", "checkpoint.save_interval=1", "train.global_batch_size=8192",
                 nproc=1)  # fmt: skip
    p = _start_logged(cmd, out, own_session=False)
    try:
        _wait_for(lambda: (run_dir / "checkpoints" / "latest").exists(), p, "no checkpoint committed", 180)
        p.send_signal(signal.SIGINT)
        _wait_for(lambda: _printed(out, ACK_SAVING), p, "the first Ctrl-C was not acknowledged during the step")
        time.sleep(REPEAT_GRACE_S + 0.5)
        recorded = len([r for r in _records(run_dir) if "loss" in r])
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, (out.read_text()[-2000:], err)
    _assert_aborted_naming_last(err, run_dir, recorded)
    assert verify_checkpoint(run_dir / "checkpoints") == []


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie nobody reaps yet counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_workers_of_a_launcher_killed_outright_stop_save_and_end(tmp_path: Path) -> None:
    """A user trial: `kill -9` of the `--nproc-per-node 2` launcher left both workers training on (their own
    sessions: nothing reached them), holding the run_dir. Each worker is now tied to its launcher
    (`prctl(PR_SET_PDEATHSIG)`): they stop as on a scheduler's SIGTERM, save the step they stopped at, and end."""
    run_dir, out = tmp_path / "run", tmp_path / "out.log"
    p = _start_logged(_train(run_dir, "train.train_iters=100000", "checkpoint.save_interval=100000"), out)
    workers: list[int] = []
    try:
        _wait_for_steps(p, run_dir, 3)
        workers = [_rank_pid(p, 0), _rank_pid(p, 1)]
        p.kill()  # the launcher only: SIGKILL leaves it no say
        p.communicate(timeout=30)
        end = time.monotonic() + 120
        while not all(_gone(w) for w in workers):
            assert time.monotonic() < end, "the workers outlived their launcher"
            time.sleep(0.1)
    finally:
        for w in workers:
            if not _gone(w):
                os.kill(w, signal.SIGKILL)
    ckpts = run_dir / "checkpoints"
    steps = [r["step"] for r in _records(run_dir) if "loss" in r]
    assert (ckpts / "latest").read_text().strip() == f"step_{steps[-1]:08d}", steps  # saved where they stopped
    assert verify_checkpoint(ckpts) == []


def test_one_sigint_to_every_process_of_the_job_stops_and_saves(tmp_path: Path) -> None:
    """A review: one SIGINT to the launcher and to each worker at once (`scancel -s INT`, `pkill -INT`) aborted
    the run unsaved as "a second Ctrl-C": a worker took the launcher's forwarded copy for a second press. It is
    one request: the ranks agree, save and exit 3."""
    run_dir, out = tmp_path / "run", tmp_path / "out.log"
    # steps of seconds (1024 micro-batches a rank): the launcher is still waiting on its workers when its own
    # SIGINT comes (with millisecond steps they had saved and ended, and the launcher died of the late signal)
    cmd = _train(run_dir, "train.train_iters=100000", "checkpoint.save_interval=100000",
                 "train.global_batch_size=8192")  # fmt: skip
    p = _start_logged(cmd, out)
    try:
        _wait_for_steps(p, run_dir, 1, deadline_s=180)
        for pid in (_rank_pid(p, 0), _rank_pid(p, 1)):
            os.kill(pid, signal.SIGINT)
        time.sleep(0.3)  # the workers have taken theirs; the launcher's forwarded copies come after
        os.kill(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        _end(p)
    assert p.returncode == 3, (out.read_text()[-2000:], err)
    steps = [r["step"] for r in _records(run_dir) if "loss" in r]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{steps[-1]:08d}" and verify_checkpoint(ckpts) == []


def test_a_ctrl_c_a_parent_forwards_again_at_once_stops_and_saves(tmp_path: Path) -> None:
    """A wrapper in the terminal's process group (a shell script, `uv run`) that forwards the Ctrl-C the launcher
    also got sends the launcher a second SIGINT at once: it aborted the run without saving. Within
    `REPEAT_GRACE_S` of the first it is the same request, as on a worker: the ranks stop and save."""
    run_dir, out = tmp_path / "run", tmp_path / "out.log"
    p = _start_logged(_train(run_dir, "train.train_iters=2000", "checkpoint.save_interval=1000"), out)
    try:
        _wait_for_steps(p, run_dir, 2)
        os.killpg(p.pid, signal.SIGINT)
        time.sleep(0.05)
        os.kill(p.pid, signal.SIGINT)  # the parent's forwarded copy
        _, err = p.communicate(timeout=120)
    finally:
        _end(p)
    assert (p.returncode, err) == (3, ""), (out.read_text()[-2000:], err)
    assert (run_dir / "checkpoints" / "latest").exists()
