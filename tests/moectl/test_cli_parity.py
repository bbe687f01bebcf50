"""`moectl parity`: the two commands of issue 20's done-when, the JSON report, usage errors, two ranks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_helpers import takes_no_file
from moectl.cli.app import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
QUICK = ["--set", "train.global_batch_size=4", "--set", "data.source=synthetic"]  # 1 micro-batch per step


def test_single_grouped_weight_flag_is_bitwise_equal_over_five_steps():
    res = runner.invoke(app, ["parity", "configs/tiny.yaml", "--flag", "moe.single_grouped_weight=true", "--steps", "5"])
    assert res.exit_code == 0, res.output
    assert "equal (bitwise) over 5 step(s)" in res.output
    assert "the config already has moe.single_grouped_weight=true" in res.output  # the default: ON is OFF


def test_the_other_expert_layout_is_bitwise_equal_and_the_json_says_so(tmp_path):
    out = tmp_path / "parity.json"
    res = runner.invoke(app, ["parity", "configs/tiny.yaml", *QUICK, "--set", "moe.single_grouped_weight=false",
                              "--flag", "moe.single_grouped_weight=true", "--steps", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "already has" not in res.output
    report = json.loads(out.read_text())
    assert report["equal"] and report["first_difference"] is None and report["mode"] == "bitwise"
    assert [r["step"] for r in report["records"]] == [1, 2]
    for r in report["records"]:
        assert r["off"]["digests"] == r["on"]["digests"] and set(r["off"]["digests"]) == {"params", "masters", "optimizer"}
        assert r["tensors_compared"] > 20 and r["differences"] == []


def test_a_learning_rate_flag_reports_the_first_differing_step(tmp_path):
    out = tmp_path / "parity.json"
    res = runner.invoke(app, ["parity", "configs/tiny.yaml", *QUICK, "--flag", "optimizer.lr=1e-3", "--steps", "3",
                              "--json", str(out)])
    assert res.exit_code == 1, res.output
    assert "different (bitwise): first at step 1: param" in res.output
    report = json.loads(out.read_text())
    first = report["first_difference"]
    assert (report["equal"], first["step"], first["what"]) == (False, 1, "param")
    one = report["records"][0]
    assert one["off"]["loss"] == one["on"]["loss"]  # step 1's loss is computed before the first update
    assert report["records"][1]["off"]["loss"] != report["records"][1]["on"]["loss"]
    rows = [line.split() for line in res.output.splitlines() if line.split()[:1] in (["2"], ["3"])]
    assert len(rows) == 2, res.output
    for row, r in zip(rows, report["records"][1:]):  # "compared" counts what "N differ" counts
        compared, differ = int(row[5]), len(r["differences"])
        assert compared == r["tensors_compared"] + 2 and 2 < differ <= compared and row[6:8] == [str(differ), "differ"]


def test_usage_errors_exit_2():
    res = runner.invoke(app, ["parity", "configs/tiny.yaml", "--flag", "optimizer.lr", "--steps", "1"])
    assert res.exit_code == 2 and "KEY=VALUE" in res.output
    res = runner.invoke(app, ["parity", "configs/tiny.yaml", "--flag", "optimizer.lrr=1", "--steps", "1"])
    assert res.exit_code == 2 and "optimizer.lrr" in res.output
    res = runner.invoke(app, ["parity", "configs/tiny.yaml", "--flag", "moe.router_topk=9", "--steps", "1"])
    assert res.exit_code == 2 and "not starting" in res.output
    res = runner.invoke(app, ["parity", "configs/tiny.yaml", "--flag", "optimizer.lr=1e-3", "--steps", "151"])
    assert res.exit_code == 2 and "train.train_iters=150" in res.output


def test_data_that_cannot_be_read_is_bad_usage_not_a_difference(tmp_path):
    """It was exit 1, which a script reads as "the flag changes the run"; `train` says 2 for the same data."""
    (tmp_path / "short.bin").write_bytes(bytes(100))  # 50 uint16 tokens: shorter than one sequence
    for path, words in ((tmp_path / "short.bin", "50 tokens is too short"), (tmp_path / "missing.bin", "no such file")):
        res = runner.invoke(app, ["parity", "configs/tiny.yaml", "--set", "data.source=tokens", "--set",
                                  f"data.path={path}", "--flag", "moe.single_grouped_weight=false", "--steps", "1"])
        errors = [line for line in res.output.splitlines() if line.startswith("error:")]
        assert res.exit_code == 2, res.output
        assert len(errors) == 1 and words in errors[0] and "Traceback" not in res.output, res.output


def test_a_warning_of_the_config_is_printed_once_not_for_off_and_on(tmp_path):
    """OFF and ON are checked apart: a missing data.path was MOE045 twice (three times under --nproc-per-node 2,
    the launched rank 0 saying it again); a warning that only ON's flag brings is still printed."""
    res = runner.invoke(app, ["parity", "configs/tiny.yaml", "--set", "data.source=tokens", "--set",
                              f"data.path={tmp_path / 'missing.bin'}", "--flag", "train.cpu_threads=4096",
                              "--steps", "1"], env={"COLUMNS": "400"})  # fmt: skip
    assert res.exit_code == 2, res.output
    assert res.output.count("MOE045") == 1 and res.output.count("MOE072") == 1, res.output


@pytest.mark.slow
def test_two_ranks_exit_1_on_a_difference_without_a_failed_child(tmp_path):
    """The ranks' verdict reaches the parent: exit 1, and torchrun reports no failed child."""
    out = tmp_path / "parity.json"
    args = [sys.executable, "-m", "moectl", "parity", "configs/tiny.yaml", *QUICK, "--set", "train.global_batch_size=8",
            "--set", "train.device=cpu", "--flag", "optimizer.lr=1e-3", "--steps", "2", "--nproc-per-node", "2",
            "--json", str(out)]  # fmt: skip
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "first at step 1" in res.stdout and "ChildFailedError" not in res.stderr
    assert json.loads(out.read_text())["first_difference"]["step"] == 1



def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(tmp_path):
    """It ran every step, then died in a traceback writing the file (a folder, or a path under a file)."""
    (tmp_path / "afile").write_text("x")

    def parity(path):
        return subprocess.run([sys.executable, "-m", "moectl", "parity", "configs/tiny.yaml", "--flag", "train.seed=2",
                               "--steps", "1", "--json", str(path)], capture_output=True, text=True, timeout=300)

    for path, says in ((tmp_path, "is a folder"), (tmp_path / "afile" / "out.json", "is a file, not a folder")):
        r = parity(path)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "loss OFF" not in r.stdout  # refused before any step
    r = parity(tmp_path / "new" / "deep" / "p.json")
    assert r.returncode == 1 and (tmp_path / "new" / "deep" / "p.json").is_file()  # its folder made


def parity_json(flag: str, path: Path) -> subprocess.CompletedProcess[str]:
    """A one-step parity run with `--json PATH`, its stdout and stderr apart."""
    return subprocess.run([sys.executable, "-m", "moectl", "parity", "configs/tiny.yaml", *QUICK, "--flag", flag,
                           "--steps", "1", "--json", str(path)], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not takes_no_file(Path("/sys")), reason="needs a folder that takes no new file")
def test_a_json_folder_that_takes_no_new_file_is_refused_before_the_run():
    """Root passed the permission-bit check of /sys (or a read-only mount): the run went to its end, then its
    JSON write failed and an equal run exited 1, "different". Now the OS is asked up front."""
    r = parity_json("moe.single_grouped_weight=true", Path("/sys/moectl-parity.json"))
    assert r.returncode == 2 and "loss OFF" not in r.stdout, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "cannot write /sys/moectl-parity.json: /sys takes no new file" in line
    assert "give a path in a writable folder" in line


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("flag, verdict", [("moe.single_grouped_weight=true", 0), ("optimizer.lr=1e-3", 1)],
                         ids=["equal", "different"])  # fmt: skip
def test_a_json_write_that_fails_after_the_run_keeps_the_verdicts_exit_code(flag: str, verdict: int):
    """A write that fails late (a full disk: /dev/full, written in place, passes the check) made every run exit
    1, the code of "different". It is one error line naming the path; the exit code is the verdict's."""
    r = parity_json(flag, Path("/dev/full"))
    assert r.returncode == verdict, r.stdout + r.stderr
    assert ("equal (bitwise)" if verdict == 0 else "different (bitwise)") in r.stdout
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    assert line.startswith("error: cannot write --json /dev/full: No space left on device. fix: ")
    assert line.endswith("the exit code is still the verdict's (0 equal, 1 different)"), line
