from typer.testing import CliRunner

from moectl.cli.app import app

runner = CliRunner()
SMALL = ["--set", "train.train_iters=2", "--set", "train.eval_interval=null", "--set", "data.source=synthetic",
         "--set", "model.seq_length=32", "--set", "checkpoint.save_interval=2"]


def test_validate_exit_codes(tmp_path):
    assert runner.invoke(app, ["train", "configs/tiny.yaml", *SMALL, "--run-dir", str(tmp_path)]).exit_code == 0
    ok = runner.invoke(app, ["ckpt", "validate", str(tmp_path / "checkpoints")])
    assert ok.exit_code == 0, ok.output
    assert "valid:" in ok.output and "master" in ok.output
    step = tmp_path / "checkpoints" / "step_00000002"
    (step / "manifest.json").write_text((step / "manifest.json").read_text().replace('"step": 2', '"step": 3'))
    bad = runner.invoke(app, ["ckpt", "validate", str(step)])
    assert bad.exit_code == 1
    assert "invalid" in bad.output and "FAIL" in bad.output


def test_a_bad_set_is_bad_usage_before_the_checkpoint_is_read(tmp_path):
    """A `--set` without a value, with an unknown key or a wrong type is the command's error (exit 2, one line),
    found before anything is read: it was a failed restore row, 'invalid', exit 1, like a corrupt checkpoint."""
    missing = tmp_path / "no_such_checkpoint"  # never opened: the overrides fail first
    for item, says in (("parallel.expert_model_parallel_size", "expected KEY=VALUE"),
                       ("parallel.expert_model_parallel_sizee=1", "did you mean"),
                       ("parallel.expert_model_parallel_size=one", "expected int")):  # fmt: skip
        r = runner.invoke(app, ["ckpt", "validate", str(missing), "--set", item])
        assert r.exit_code == 2, r.output
        assert says in r.output and "invalid" not in r.output and "FAIL" not in r.output
