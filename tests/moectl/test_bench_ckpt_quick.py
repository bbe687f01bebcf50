"""`moectl bench ckpt --quick`: every measure and its floor through the CLI on a CPU, and on two gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpt.save import PHASES
from dist_helpers import run_distributed
from moectl.cli.app import app

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
MEASURES = [
    ("plain sequential write (floor)", None),
    ("save, synchronous", "plain write"),
    ("save, background: host buffers reserved at start-up", None),
    ("save, background (first save): blocking", None),
    ("save, background (first save): total", "plain write"),
    ("save, background (second save): blocking", None),
    ("save, background (second save): total", "plain write"),
    ("raw read (floor)", None),
    ("raw copy: read + write (floor)", None),
    ("ckpt inspect --verify", "raw read"),
    ("ckpt convert", "raw copy"),
    ("ckpt validate", "raw read"),
]


def _check(data: dict[str, Any], world: int) -> None:
    rows = data["rows"]
    assert [(r["measure"], r["floor"]) for r in rows] == MEASURES
    by = {r["measure"]: r for r in rows}
    for r in rows:
        assert r["seconds"] > 0 and r["bytes"] == data["meta"]["checkpoint_bytes"] > 0, r
        if r["floor"]:
            floor = {"plain write": "plain sequential write (floor)", "raw read": "raw read (floor)",
                     "raw copy": "raw copy: read + write (floor)"}[r["floor"]]  # fmt: skip
            assert r["floor_seconds"] == by[floor]["seconds"] and r["vs_floor"] == r["seconds"] / r["floor_seconds"]
    for label in ("first", "second"):  # training waits for the copy, not for the write
        blocking, total = (by[f"save, background ({label} save): {part}"]["seconds"] for part in ("blocking", "total"))
        assert blocking < total
        assert set(by[f"save, background ({label} save): total"]["phases"]) == set(PHASES)  # where the time went
    assert set(by["save, synchronous"]["phases"]) == {*PHASES, "gather_s"}
    assert data["meta"]["world_size"] == world and data["meta"]["files"] >= 2 * world - 1
    assert by["ckpt convert"]["to"] == "per-expert"  # tiny.yaml's experts are one grouped tensor


def test_quick_run_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "ckpt.json"
    res = CliRunner().invoke(app, ["bench", "ckpt", str(TINY), "--quick", "--set", "data.source=synthetic",
                                   "--dir", str(tmp_path / "b"), "--json", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "checkpoint I/O" in res.output and "ckpt validate" in res.output
    data = json.loads(out.read_text())
    _check(data, 1)
    assert data["meta"]["host"]["cpus"] >= 1 and "filesystem" in data["meta"]["host"]
    assert not (tmp_path / "b").exists()  # removed unless --keep


def test_saves_only_measures_the_saves_and_skips_the_tools(tmp_path: Path) -> None:
    out = tmp_path / "ckpt.json"
    res = CliRunner().invoke(app, ["bench", "ckpt", str(TINY), "--quick", "--saves-only", "--set",
                                   "data.source=synthetic", "--dir", str(tmp_path / "b"), "--json", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    measures = {r["measure"] for r in data["rows"]}
    assert {"plain sequential write (floor)", "save, synchronous", "save, background (second save): total"} <= measures
    assert not any(m.startswith(("ckpt ", "raw ")) for m in measures), measures
    assert data["meta"]["saves_only"] is True and any("--saves-only" in n for n in data["notes"])
    assert not (tmp_path / "b").exists()


def test_a_folder_holding_the_users_files_is_refused_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench replaces --dir at start and removes it at the end: a run's checkpoints or the current folder
    given as --dir were deleted. Now such a folder is refused untouched; an earlier bench's (--keep) is reused,
    and the default folder's parents that the bench made are removed with it (no empty runs/tiny/ left)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "important.txt").write_text("precious")
    monkeypatch.chdir(tmp_path)
    for folder, words in ((mine, "entries the bench did not write"), (Path("."), "the current folder")):
        res = CliRunner().invoke(app, ["bench", "ckpt", str(TINY), "--quick", "--saves-only", "--dir", str(folder)])
        assert res.exit_code == 2 and words in res.output, res.output
    assert (mine / "important.txt").read_text() == "precious" and sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    kept = tmp_path / "kept"
    args = ["bench", "ckpt", str(TINY), "--quick", "--saves-only", "--set", "data.source=synthetic"]
    for _ in range(2):  # the second run takes the first one's kept folder
        assert CliRunner().invoke(app, [*args, "--dir", str(kept), "--keep"]).exit_code == 0
    res = CliRunner().invoke(app, args)  # default folder: runs/tiny/bench_ckpt under the working folder
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "mine"]
    # a kept folder the user has since put a file into is no longer only the bench's: refused, the file kept
    # (it took any folder holding the marker, and emptied it whole)
    (kept / "notes.txt").write_text("mine")
    res = CliRunner().invoke(app, [*args, "--dir", str(kept)])
    assert res.exit_code == 2 and "(e.g. notes.txt)" in res.output, res.output
    assert (kept / "notes.txt").read_text() == "mine"
    dangling = tmp_path / "dangling"  # a folder the bench cannot make: one line, exit 2, no traceback
    dangling.symlink_to(tmp_path / "nowhere" / "x")
    res = CliRunner().invoke(app, [*args, "--dir", str(dangling)])
    assert res.exit_code == 2 and "bench ckpt --dir" in res.output and "Traceback" not in res.output, res.output
    dangling.unlink()
    empty = tmp_path / "empty"  # an empty folder the user made (a mount point, say) is emptied, never removed
    empty.mkdir()
    assert CliRunner().invoke(app, [*args, "--dir", str(empty)]).exit_code == 0
    assert empty.is_dir() and list(empty.iterdir()) == []


def _interrupted(exc: BaseException) -> Any:
    def stop(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return stop


def test_an_interrupted_run_removes_what_it_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during the last measure left the run's scratch files (its checkpoints, its marker) and the folders it
    made in --dir until the next run emptied them. Now they go, and the line and 130 are Ctrl-C's."""
    import trainer.validation

    monkeypatch.setattr(trainer.validation, "validate_checkpoint", _interrupted(KeyboardInterrupt()))
    monkeypatch.delenv("MOECTL_LAUNCHED", raising=False)
    res = CliRunner().invoke(app, ["bench", "ckpt", str(TINY), "--quick", "--set", "data.source=synthetic",
                                   "--dir", str(tmp_path / "made" / "b"), "--keep"])  # fmt: skip
    assert res.exit_code == 130, res.output
    assert res.output.splitlines()[-1] == ("error: stopped by SIGINT before `moectl bench ckpt` finished. fix: run "
                                           "it again") and "Traceback" not in res.output  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # the parent it made too; --keep is for a run that finishes


def test_a_run_stopped_during_a_background_save_leaves_the_users_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while the background save's writer thread is still writing into the folder (held 1 s before its
    commit): the save ends before the folder is emptied, or its commit lands in the emptied folder. A folder
    that was there (empty, the user's) stays, and so does what lies beside it."""
    import signal

    from ckpt import faults
    from moectl.cli.base import Stopped
    from trainer.checkpointing.saver import RunCheckpointer

    mount = tmp_path / "mount"
    mount.mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setenv(faults.ENV, "0:before_manifest:slow")
    monkeypatch.setattr(RunCheckpointer, "finish", _interrupted(Stopped(signal.SIGTERM)))
    monkeypatch.delenv("MOECTL_LAUNCHED", raising=False)
    res = CliRunner().invoke(app, ["bench", "ckpt", str(TINY), "--quick", "--set", "data.source=synthetic",
                                   "--dir", str(mount)])  # fmt: skip
    assert res.exit_code == 143, res.output
    assert mount.is_dir() and list(mount.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mount", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def _two_ranks(rank: int, world_size: int, folder: str) -> Any:
    from moectl.bench import ckpt_bench as cb

    bench = cb.CkptBenchConfig(config=TINY, sets=["data.source=synthetic"], folder=Path(folder), quick=True)
    cfg = cb.bench_config(bench, world_size)
    return cb.run(bench, cfg, {"config": str(TINY)}).to_json()


@pytest.mark.slow
def test_quick_run_on_two_ranks(tmp_path: Path) -> None:
    r0, _ = run_distributed(_two_ranks, world_size=2, timeout=60, folder=str(tmp_path / "b"))
    _check(r0, 2)


class _ShortWrites:
    """A file whose `write` takes at most 5 bytes a call, as Linux takes at most 2 GiB - 4 KiB."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b: memoryview) -> int:
        self.data += bytes(b[:5])
        return min(5, len(b))


def test_the_plain_floor_writes_every_byte_despite_short_writes() -> None:
    # One unbuffered write() of a file over 2 GiB writes 2 GiB - 4 KiB and returns the count: the floor
    # must loop, or it times a fraction of the bytes (it did, until the ninth session).
    from moectl.bench.ckpt_bench import write_all

    f = _ShortWrites()
    payload = bytes(range(256)) * 3
    write_all(f, memoryview(payload))
    assert bytes(f.data) == payload


def test_plain_write_leaves_files_of_their_full_size(tmp_path: Path) -> None:
    from moectl.bench.ckpt_bench import plain_write

    blobs = {"a.bin": b"x" * 100_003, "b.bin": b""}
    plain_write(blobs, tmp_path / "p")
    assert {n: (tmp_path / "p" / n).stat().st_size for n in blobs} == {"a.bin": 100_003, "b.bin": 0}


@pytest.mark.parametrize("phase", ["moectl.bench.ckpt_bench.raw_copy", "ckpt.convert.convert_checkpoint"],
                         ids=["copy", "convert"])  # fmt: skip
def test_a_run_stopped_in_a_tool_empties_the_users_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          phase: str) -> None:  # fmt: skip
    """The tools write copy/ and converted/ into the folder too: stopped there, a checkpoint-sized copy was left
    in a folder the user owns, and the next run refused it as someone else's."""
    import importlib

    def half_done(src: Any, dest: Path, *args: Any) -> None:
        Path(dest).mkdir(parents=True)
        (Path(dest) / "part").write_bytes(b"x" * 1024)
        raise KeyboardInterrupt

    module, name = phase.rsplit(".", 1)
    monkeypatch.setattr(importlib.import_module(module), name, half_done)
    monkeypatch.delenv("MOECTL_LAUNCHED", raising=False)
    mine = tmp_path / "mount"  # the user's, there before: emptied, never removed
    mine.mkdir()
    res = CliRunner().invoke(app, ["bench", "ckpt", str(TINY), "--quick", "--set", "data.source=synthetic",
                                   "--dir", str(mine)])  # fmt: skip
    assert res.exit_code == 130, res.output
    assert mine.is_dir() and list(mine.iterdir()) == []


def test_data_that_cannot_be_read_is_bad_input(tmp_path: Path) -> None:
    """A data.path that does not exist ended the bench 1 ("failed"); `train` refuses the same config with 2."""
    missing = tmp_path / "nope.bin"
    res = CliRunner().invoke(app, ["bench", "ckpt", str(TINY), "--quick", "--dir", str(tmp_path / "b"), "--set",
                                   "data.source=tokens", "--set", f"data.path={missing}"])  # fmt: skip
    assert res.exit_code == 2 and f"error: {missing}: no such file" in res.output, res.output
    assert not (tmp_path / "b").exists()


def test_a_launched_bench_refuses_a_bad_config_before_starting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under --nproc-per-node each worker checked the rules after torchrun's start-up: one error line per
    worker. Now the launcher refuses before starting any process, as `train` does."""
    import moectl.cli.launch as launch

    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: pytest.fail("launched a refused bench"))
    res = CliRunner().invoke(app, ["bench", "ckpt", str(TINY), "--quick", "--nproc-per-node", "2", "--dir",
                                   str(tmp_path / "b"), "--set", "train.global_batch_size=6"])  # fmt: skip
    assert res.exit_code == 2 and "MOE030" in res.output, res.output
    assert res.output.count("error:") == 2, res.output  # the rule's line, then the refusal
