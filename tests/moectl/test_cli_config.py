"""`moectl config keys` lists the schema (every key, type, default, docstring); `train --help` says where
results go and how to resume (issue 18: neither was reachable from the CLI)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from moectl.cli.app import app
from moectl.core.config import config_to_dict
from moectl.core.config.load import load_config

runner = CliRunner()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_config_keys_json_is_the_whole_schema_with_defaults_and_docs() -> None:
    r = runner.invoke(app, ["config", "keys", "--json"])
    assert r.exit_code == 0, r.output
    keys = json.loads(r.stdout)
    defaults = _flatten(config_to_dict(load_config(None)))
    assert [k["key"] for k in keys] == list(defaults)  # every key, in schema order, nothing else
    for k in keys:
        assert k["default"] == defaults[k["key"]] and k["help"] and k["type"], k
    by_key = {k["key"]: k for k in keys}
    assert by_key["parallel.distributed_timeout_minutes"] == {
        "key": "parallel.distributed_timeout_minutes", "type": "float", "default": 10.0,
        "help": by_key["parallel.distributed_timeout_minutes"]["help"],
    }
    assert by_key["optimizer.optimizer"]["type"] == "'adam' | 'muon' | 'sgd'"
    assert by_key["train.cpu_threads"]["type"] == "int | null"


def test_config_keys_table_filters_by_section_and_refuses_an_unknown_one() -> None:
    r = runner.invoke(app, ["config", "keys", "optimizer"])
    assert r.exit_code == 0 and "optimizer.lr " in r.output and "train.seed" not in r.output
    bad = runner.invoke(app, ["config", "keys", "optimiser"])
    assert bad.exit_code == 2 and "use one of" in bad.output and "Traceback" not in bad.output
    assert "did you mean 'optimizer'?" in bad.output
    bad = runner.invoke(app, ["config", "keys", "optimizer.lrr"])  # a mistyped key, not only a section
    assert bad.exit_code == 2 and "did you mean 'optimizer.lr'?" in bad.output
    r = runner.invoke(app, ["config", "keys", "moe.router"], env={"COLUMNS": "200"})  # any prefix, as its help says
    assert r.exit_code == 0 and "moe.router_topk" in r.output and "moe.num_experts" not in r.output


def test_train_help_says_where_results_go_and_how_to_resume() -> None:
    r = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    for words in ("metrics.jsonl", "config.yaml", "checkpoints/latest", "--set checkpoint.load=RUN_DIR/checkpoints",
                  "--overwrite", "3 stopped by SIGTERM/SIGINT/SIGHUP after saving"):
        assert words in text, words


def test_config_keys_show_bracketed_help_text() -> None:
    """Rich read '[gate; up]' in a help text as markup and dropped it."""
    from typer.testing import CliRunner

    from moectl.cli.app import app

    res = CliRunner().invoke(app, ["config", "keys", "moe.glu_interleave_size"], env={"COLUMNS": "300"})
    assert res.exit_code == 0 and "[gate; up]" in res.output and "[gate(I), up(I), ...]" in res.output, res.output
