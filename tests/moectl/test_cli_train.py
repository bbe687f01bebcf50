import json

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


def test_train_bad_key_is_one_line_exit_2(tmp_path):
    res = runner.invoke(app, ["train", "configs/tiny.yaml", "--set", "train.train_iter=3"])
    assert res.exit_code == 2
    assert "did you mean 'train_iters'" in res.output
    assert "Traceback" not in res.output
