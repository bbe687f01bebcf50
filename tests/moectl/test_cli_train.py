import json
from pathlib import Path

from typer.testing import CliRunner

from moectl.cli.app import app

runner = CliRunner()
SMALL = ["--set", "train.train_iters=2", "--set", "train.eval_interval=1", "--set", "data.source=synthetic",
         "--set", "model.seq_length=32"]


def test_train_runs_and_writes_metrics(tmp_path):
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    assert "done: 2 steps" in res.output
    records = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]


def test_train_refuses_to_start_on_rule_errors(tmp_path):
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "r"),
                              "--set", "moe.router_topk=9"])
    assert res.exit_code == 2
    assert "not starting" in res.output and "moe.router_topk" in res.output
    assert not (tmp_path / "r").exists()
    # off a terminal (a log): one plain line per violation, no table
    assert "error: MOE018 moe.router_topk=9, moe.num_experts=" in res.output and "┃" not in res.output


def test_train_bad_key_is_one_line_exit_2(tmp_path):
    res = runner.invoke(app, ["train", "configs/tiny.yaml", "--set", "train.train_iter=3"])
    assert res.exit_code == 2
    assert "did you mean 'train_iters'" in res.output
    assert "Traceback" not in res.output


def _one_error_line(res) -> str:
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.output, res.output
    return errors[0]


def test_run_dir_problems_are_one_line_and_exit_2(tmp_path):
    """Issue 18: each of these was a traceback."""
    (tmp_path / "afile").write_text("in the way")
    (tmp_path / "m" / "metrics.jsonl").mkdir(parents=True)
    cases = {
        str(tmp_path / "afile"): "a file is in the way",
        str(tmp_path / "afile" / "run"): "is a file, not a folder",
        "/proc/moectl-test/run": "this filesystem does not allow creating it",
        "/dev/null": "run_dir /dev/null exists and is not a directory: it is a character device. fix: choose another",
        str(tmp_path / "m"): "metrics.jsonl is a folder",
    }
    for run_dir, words in cases.items():
        res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", run_dir])
        assert res.exit_code == 2, (run_dir, res.output)
        assert words in _one_error_line(res), res.output


def test_bad_config_files_are_one_line_and_exit_2(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("model:\n  num_layers: 1  # café\n".encode("latin-1"))
    twice = tmp_path / "twice.yaml"
    twice.write_text("moe:\n  num_experts: 4\ntrain:\n  seed: 1\nmoe:\n  router_topk: 1\n")
    for path, words in ((latin1, "not UTF-8 text: byte 0xe9 at line 2"), (twice, "key 'moe' appears twice (lines 1 and 5)")):
        res = runner.invoke(app, ["train", str(path), "--run-dir", str(tmp_path / "r")])
        assert res.exit_code == 2 and words in _one_error_line(res), res.output
    assert not (tmp_path / "r").exists()


def test_training_again_into_a_used_run_dir_is_refused_unless_overwrite(tmp_path):
    assert runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path)]).exit_code == 0
    before = (tmp_path / "metrics.jsonl").read_bytes()
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path),
                              "--set", "optimizer.lr=2e-3"])
    assert res.exit_code == 2
    assert "holds another run's metrics.jsonl" in _one_error_line(res)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path),
                              "--set", "optimizer.lr=2e-3", "--overwrite"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "metrics.jsonl").read_bytes() != before


def test_an_empty_run_dir_is_refused_not_the_current_folder(tmp_path, monkeypatch):
    """`--run-dir "$UNSET"`: Typer's Path made "" into ".", and the run wrote into the current folder."""
    monkeypatch.chdir(tmp_path)
    config = str(Path(__file__).parents[2] / "configs/tiny.yaml")
    res = runner.invoke(app, ["train", config, *SMALL, "--run-dir", ""])
    assert res.exit_code == 2 and "MOE068" in res.output, res.output
    assert list(tmp_path.iterdir()) == []


def test_the_config_file_given_is_never_replaced_by_the_resolved_one(tmp_path):
    """A config that is run_dir/config.yaml: a user's file is refused untouched; one a run wrote is rewritten."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    mine = run_dir / "config.yaml"
    mine.write_text(Path("configs/tiny.yaml").read_text() + "# my notes\n")
    before = mine.read_bytes()
    res = runner.invoke(app, ["train", str(mine), *SMALL, "--run-dir", str(run_dir)])
    assert res.exit_code == 2 and "would replace your file" in _one_error_line(res), res.output
    assert mine.read_bytes() == before and sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]
    # a run's own config.yaml, passed back to resume it with an override: rewritten, as before
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "own"),
                              "--set", "checkpoint.save_interval=2"])  # fmt: skip
    assert res.exit_code == 0, res.output
    own = tmp_path / "own" / "config.yaml"
    res = runner.invoke(app, ["train", str(own), *SMALL[2:], "--set", "train.train_iters=3",
                              "--set", f"checkpoint.load={tmp_path / 'own' / 'checkpoints'}"])  # fmt: skip
    assert res.exit_code == 0 and "done: 3 steps" in res.output, res.output
    assert "train_iters: 3" in own.read_text()


def test_a_resume_with_nothing_left_to_train_says_so(tmp_path):
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "r"),
                              "--set", "checkpoint.save_interval=2"])  # fmt: skip
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "r"),
                              "--set", f"checkpoint.load={tmp_path / 'r' / 'checkpoints'}"])  # fmt: skip
    assert res.exit_code == 0 and "nothing to train (raise train.train_iters" in res.output, res.output


def test_a_run_folder_as_checkpoint_load_is_bad_usage_naming_its_checkpoints(tmp_path):
    """A user trial: checkpoint.load at a run folder (not its checkpoints folder) exited 1 (failed); a file there
    exited 2. Both are the config's fault: refused with exit 2, naming what to point checkpoint.load at."""
    run = tmp_path / "r"
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(run),
                              "--set", "checkpoint.save_interval=2"])  # fmt: skip
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "next"),
                              "--set", f"checkpoint.load={run}"])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert _one_error_line(res) == (f"error: {run} is a run folder, not a checkpoint. "
                                    f"fix: point checkpoint.load at {run / 'checkpoints'} (its latest step, "
                                    "step_00000002)")


def test_checkpoint_load_at_a_folder_that_is_no_checkpoints_folder_is_bad_usage(tmp_path):
    """A user trial: checkpoint.load at an HF model folder or an empty folder exited 1 (failed), as a bad
    checkpoint; the config names the wrong folder: exit 2. A checkpoints folder with nothing committed yet is 1."""
    hf, empty = tmp_path / "hf", tmp_path / "empty"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    empty.mkdir()
    fix = ("fix: set checkpoint.load to a step_NNNNNNNN folder or a checkpoints folder, or to null to train from "
           "scratch")
    for load, said in ((hf, "it looks like a Hugging Face model folder"), (empty, "it is not a checkpoints folder")):
        res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "next"),
                                  "--set", f"checkpoint.load={load}"])  # fmt: skip
        assert res.exit_code == 2, res.output
        line = _one_error_line(res)
        assert f"no committed checkpoint in {load}; {said}" in line and line.endswith(fix), line
    (tmp_path / "checkpoints" / "step_00000002.tmp-ab12").mkdir(parents=True)
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "next"),
                              "--set", f"checkpoint.load={tmp_path / 'checkpoints'}"])  # fmt: skip
    assert res.exit_code == 1 and "no step was committed yet" in _one_error_line(res), res.output


def test_a_fresh_saving_run_into_another_runs_checkpoints_is_bad_usage(tmp_path):
    """Refused before training like the other run_dir refusals, so with their exit code (2), not 1 (failed)."""
    run = ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "r"), "--set", "checkpoint.save_interval=2"]
    assert runner.invoke(app, run).exit_code == 0
    res = runner.invoke(app, [*run, "--overwrite"])
    assert res.exit_code == 2 and "already holds checkpoints of an earlier run" in _one_error_line(res), res.output


def test_a_config_yaml_from_before_the_header_is_taken_back_when_unchanged(tmp_path):
    """A run's config.yaml written before the header line: passed back unchanged it is the resolved config, so
    the run may rewrite it; edited, it is the user's and refused."""
    from moectl.core.config.dump import dump_config
    from moectl.core.config.load import load_config

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    old = run_dir / "config.yaml"
    old.write_text(dump_config(load_config("configs/tiny.yaml", [*SMALL[1::2], f"run_dir={run_dir}"])))
    res = runner.invoke(app, ["train", str(old)])
    assert res.exit_code == 0, res.output
    old.write_text(old.read_text().split("\n", 1)[1] + "# edited\n")  # the header dropped, a note added
    res = runner.invoke(app, ["train", str(old), "--overwrite"])
    assert res.exit_code == 2 and "would replace your file" in _one_error_line(res)


def test_a_run_dir_is_taken_as_given_not_parsed_as_yaml(tmp_path):
    """--run-dir went through a YAML override: json.dumps escaped an emoji into surrogates, which then failed."""
    run_dir = tmp_path / "r 😀: [x]"
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(run_dir)])
    assert res.exit_code == 0, res.output
    assert (run_dir / "metrics.jsonl").is_file()


def test_cuda_asked_for_without_a_gpu_is_bad_usage(tmp_path):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal needs a machine without a GPU")
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "r"),
                              "--set", "train.device=cuda"])  # fmt: skip
    assert res.exit_code == 2 and "no CUDA device is visible" in _one_error_line(res)


def test_data_that_cannot_be_read_at_start_up_is_bad_usage_exit_2(tmp_path):
    """Nothing was trained: exit 2, as for a bad config (moectl/cli/exit_codes.py), with one line."""
    (tmp_path / "x.bin").write_bytes(b"garbage")
    for path, words in ((tmp_path / "missing", "no such file"), (tmp_path / "x", "x.idx")):
        res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "r"),
                                  "--set", "data.source=megatron", "--set", f"data.path={path}"])  # fmt: skip
        assert res.exit_code == 2 and words in _one_error_line(res), res.output


def test_a_bad_ckpt_threads_variable_is_refused_before_any_step(tmp_path, monkeypatch):
    """A synchronous save read MOECTL_CKPT_THREADS only at its first save: every step up to it trained, then the
    save failed (exit 1) and the run was lost; a background one failed at start-up with a traceback."""
    monkeypatch.setenv("MOECTL_CKPT_THREADS", "four")
    for async_save in ("false", "true"):
        run_dir = tmp_path / f"r{async_save}"
        res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(run_dir),
                                  "--set", "checkpoint.save_interval=2", "--set", f"checkpoint.async_save={async_save}"])
        assert res.exit_code == 2, res.output
        assert "MOECTL_CKPT_THREADS='four' is not a positive integer" in _one_error_line(res)
        assert "step 1" not in res.output and not run_dir.exists()


def test_a_model_too_big_for_memory_is_one_line_exit_1(tmp_path):
    """A 10^12-token RoPE table (4 TB) died with the CPU allocator's traceback; out of memory is a failure
    of the run (exit 1), said in one line naming where it happened and what to shrink. 10^14 tokens here: 6.4 PB
    is past any machine's address space, so the allocation fails even where memory is overcommitted."""
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "r"),
                              "--set", "model.seq_length=100000000000000"])  # fmt: skip
    line = _one_error_line(res)
    assert res.exit_code == 1, res.output
    assert "out of memory: DefaultCPUAllocator" in line and "before the first step" in line
    assert "fix: make train.micro_batch_size or the model smaller" in line


def test_out_of_memory_during_a_step_names_the_step(tmp_path, monkeypatch):
    import trainer.loop

    def train(cfg, observer, *, state, **kw):
        state.step = 3
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 99 bytes.")

    monkeypatch.setattr(trainer.loop, "train", train)
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 1 and "(at step 3)" in _one_error_line(res), res.output


def test_the_last_line_names_only_the_metrics_files_written(tmp_path):
    """`logging.jsonl: false` ended with "metrics in RUN_DIR/metrics.jsonl", a file that was never written."""
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "r"),
                              "--set", "logging.jsonl=false"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    assert "metrics.jsonl" not in res.output
    assert "no metrics file (logging.jsonl and logging.tensorboard are off)" in res.output


def test_a_compile_backend_torch_does_not_know_is_one_line_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("MOECTL_COMPILE_BACKEND", "nope")
    res = runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path / "r"),
                              "--set", "train.compile=regional"])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "MOECTL_COMPILE_BACKEND='nope' is not a torch.compile backend" in _one_error_line(res)
