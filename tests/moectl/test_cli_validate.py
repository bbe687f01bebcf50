"""`moectl validate-config` through Typer's runner on the real app: exit codes, output, --json shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moectl.cli.app import app
from moectl.core.rules import RULES

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
runner = CliRunner()
VIOLATION_KEYS = {"rule", "severity", "keys", "message", "fix"}


def invoke(*args: str):
    # a wide terminal keeps table cells on one line, so the asserts can look for whole keys
    return runner.invoke(app, ["validate-config", *args], env={"COLUMNS": "200", "MOECTL_DEBUG": ""})


def as_json(result) -> dict:
    return json.loads(result.stdout)


def test_valid_config_exits_0_with_a_summary() -> None:
    r = invoke(TINY)
    assert r.exit_code == 0, r.output
    assert "valid" in r.stdout and "invalid" not in r.stdout
    for label in ("world", "params", "memory", "device"):
        assert label in r.stdout
    assert "156K total" in r.stdout  # the tiny model's parameter count


def test_violations_exit_1_and_show_rule_keys_and_fix() -> None:
    r = invoke(TINY, "--set", "parallel.overlap_param_gather=true", "--set", "parallel.overlap_grad_reduce=false",
               "--set", "moe.router_topk=9")
    assert r.exit_code == 1, r.output
    for text in ("MOE016", "MOE018", "moe.router_topk=9", "parallel.overlap_grad_reduce=true", "error", "invalid"):
        assert text in r.stdout


def test_warnings_alone_exit_0() -> None:
    r = invoke(TINY, "--set", "mixed_precision.fp8=e4m3", "--device-capability", "9.0")
    assert r.exit_code == 0, r.output
    assert "MOE008" in r.stdout and "warning" in r.stdout


def test_json_shape_valid() -> None:
    r = invoke(TINY, "--json")
    assert r.exit_code == 0, r.output
    out = as_json(r)
    assert set(out) == {"valid", "load_errors", "violations", "summary"} and out["load_errors"] == []
    assert out["valid"] is True and out["violations"] == []
    s = out["summary"]
    assert s["layout"] == {"world_size": 1, "dp": 1, "ep": 1, "expert_dp": 1, "experts_per_rank": 4}
    assert s["params"]["total"] == 156480 and s["params"]["active"] == 107328
    assert s["memory"]["total"] == sum(s["memory"][k] for k in ("weights", "grads", "masters", "optimizer"))


def test_json_shape_with_violations() -> None:
    r = invoke(TINY, "--json", "--set", "mixed_precision.fp8_param_gather=true", "--set", "model.num_query_groups=3")
    assert r.exit_code == 1
    out = as_json(r)
    assert out["valid"] is False
    assert [v["rule"] for v in out["violations"]] == ["MOE002", "MOE032"]
    for v in out["violations"]:
        assert set(v) == VIOLATION_KEYS
        assert v["severity"] in ("error", "warning") and isinstance(v["keys"], dict)
    assert out["violations"][0]["keys"] == {"mixed_precision.fp8_param_gather": True, "mixed_precision.fp8": None}


def test_world_size_is_checked() -> None:
    sets = ["--set", "parallel.expert_model_parallel_size=2", "--json"]
    assert invoke(TINY, *sets).exit_code == 0  # default world size = ep = 2; 16 = 4 x 2 x 2
    r = invoke(TINY, *sets, "--world-size", "3")
    assert r.exit_code == 1
    assert {v["rule"] for v in as_json(r)["violations"]} == {"MOE029", "MOE030"}
    r = invoke(TINY, *sets, "--world-size", "4")
    assert r.exit_code == 0 and as_json(r)["summary"]["layout"]["expert_dp"] == 2


def test_world_size_must_be_positive() -> None:
    assert invoke(TINY, "--world-size", "0").exit_code == 2


def test_device_capability_makes_emulation_an_error_under_emulate_never() -> None:
    sets = [
        "--set",
        "mixed_precision.bf16=true",
        "--set",
        "mixed_precision.fp8=e4m3",
        "--set",
        "mixed_precision.fp8_recipe=mxfp8",
        "--set",
        "mixed_precision.emulate=never",
        "--json",
    ]
    r = invoke(TINY, *sets, "--device-capability", "9.0")
    assert r.exit_code == 1
    (v,) = as_json(r)["violations"]
    assert v["rule"] == "MOE038" and v["severity"] == "error" and v["keys"]["device"].startswith("sm90")
    assert invoke(TINY, *sets, "--device-capability", "sm100").exit_code == 1  # no native mxfp8 in this build
    tensorwise = [s.replace("mxfp8", "tensorwise") for s in sets]
    assert invoke(TINY, *tensorwise, "--device-capability", "sm100").exit_code == 0
    assert invoke(TINY, *sets, "--device-capability", "cpu").exit_code == 1


def test_bad_device_capability_is_a_usage_error() -> None:
    r = invoke(TINY, "--device-capability", "hopper")
    assert r.exit_code == 2
    assert "--device-capability" in r.stderr and "fix:" in r.stderr


def test_unknown_key_exits_2_with_did_you_mean(tmp_path: Path) -> None:
    p = tmp_path / "typo.yaml"
    p.write_text("moe:\n  num_expert: 8\n")
    r = invoke(str(p))
    assert r.exit_code == 2
    assert "moe.num_expert" in r.stderr and "did you mean 'num_experts'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


def test_debug_adds_the_traceback_and_keeps_the_line_and_exit_code(tmp_path: Path) -> None:
    p = tmp_path / "typo.yaml"
    p.write_text("moe:\n  num_expert: 8\n")
    r = runner.invoke(app, ["validate-config", str(p)], env={"COLUMNS": "200", "MOECTL_DEBUG": "1"})
    assert r.exit_code == 2  # as without MOECTL_DEBUG (it was 1: the exception escaped)
    assert "Traceback" in r.stderr and "error: moe.num_expert" in r.stderr and "fix:" in r.stderr


def test_unknown_set_key_exits_2() -> None:
    r = invoke(TINY, "--set", "optimizer.lrr=1e-3")
    assert r.exit_code == 2 and "did you mean 'lr'" in r.stderr


def test_type_error_exits_2_naming_key_value_and_type() -> None:
    r = invoke(TINY, "--set", "moe.num_experts=many")
    assert r.exit_code == 2
    assert "moe.num_experts='many'" in r.stderr and "expected int" in r.stderr


def test_bad_yaml_exits_2(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("model: [unclosed\n")
    r = invoke(str(p))
    assert r.exit_code == 2
    assert "not valid YAML" in r.stderr and "line" in r.stderr


def test_missing_file_exits_2(tmp_path: Path) -> None:
    r = invoke(str(tmp_path / "nope.yaml"), "--json")
    assert r.exit_code == 2
    assert "not found" in r.stderr  # the line on stderr; stdout still one JSON object for a script
    assert as_json(r)["valid"] is False and "not found" in as_json(r)["load_errors"][0]


def test_missing_config_exits_2() -> None:
    r = invoke()
    assert r.exit_code == 2 and "CONFIG" in r.stderr


def test_explain_prints_the_rationale_without_a_config() -> None:
    r = invoke("--explain", "moe010")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("MOE010")
    assert RULES["MOE010"].rationale.split()[0] in r.stdout and "mixed_precision.fp8_param_gather" in r.stdout


def test_explain_json_and_all() -> None:
    r = invoke("--explain", "MOE034", "--json")
    assert as_json(r)["rule"] == "MOE034" and as_json(r)["rationale"] == RULES["MOE034"].rationale
    r = invoke("--explain", "all", "--json")
    assert [x["rule"] for x in as_json(r)] == list(RULES)
    r = invoke("--explain", "all")
    assert r.exit_code == 0 and all(rid in r.stdout for rid in RULES)


def test_explain_unknown_rule_exits_2_with_suggestion() -> None:
    r = invoke("--explain", "MOE0100")
    assert r.exit_code == 2 and "did you mean MOE010" in r.stderr
    r = invoke("--explain", "nonsense")
    assert r.exit_code == 2 and "--explain all" in r.stderr
    r = invoke("--explain", "moe42")  # a mistyped prefix or padding is read by its number
    assert r.exit_code == 2 and "did you mean MOE042" in r.stderr
    r = invoke("--explain", "MOE999")  # well-formed: spelling says nothing about which rule was meant
    assert r.exit_code == 2 and "did you mean" not in r.stderr and "MOE001.." in r.stderr
    r = invoke("--explain", "MOE50")  # read by its number: a retired rule says so
    assert r.exit_code == 2 and "MOE050 is retired" in r.stderr
    for rid in ("MOE", "MOE1000"):  # no digits, or past the range: no guess
        r = invoke("--explain", rid)
        assert r.exit_code == 2 and "did you mean" not in r.stderr and "MOE001.." in r.stderr


def test_help_has_examples() -> None:
    r = invoke("--help")
    assert r.exit_code == 0
    assert "Examples:" in r.stdout and "moectl validate-config configs/tiny.yaml" in r.stdout


@pytest.mark.parametrize("flag", ["--set", "-s"])
def test_set_is_repeatable_with_short_form(flag: str) -> None:
    r = invoke(TINY, flag, "moe.num_experts=8", flag, "moe.router_topk=9", "--json")
    assert [v["rule"] for v in as_json(r)["violations"]] == ["MOE018"]
    assert as_json(r)["violations"][0]["keys"] == {"moe.router_topk": 9, "moe.num_experts": 8}


def test_gpu_memory_warns_when_the_estimate_does_not_fit() -> None:
    mixtral = str(REPO / "configs" / "mixtral_8x7b_like.yaml")
    r = invoke(mixtral, "--world-size", "8", "--gpu-memory", "H100", "--json")
    assert r.exit_code == 0, r.output  # a warning: still valid
    (hit,) = [v for v in as_json(r)["violations"] if v["rule"] == "MOE056"]
    assert hit["severity"] == "warning" and "92.2 GiB per rank" in hit["message"]
    assert invoke(mixtral, "--world-size", "8", "--gpu-memory", "141").exit_code == 0
    assert "MOE056" not in invoke(mixtral, "--world-size", "8", "--gpu-memory", "H200").output
    bad = invoke(mixtral, "--gpu-memory", "lots")
    assert bad.exit_code == 2 and bad.output.count("\n") == 1 and "--gpu-memory 'lots'" in bad.output


def test_every_load_error_is_a_line_and_json_still_gets_an_object(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_size: sixtyfour\noptimizer:\n  lrr: 0.1\n")
    res = invoke(str(bad))
    assert res.exit_code == 2
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "model.hidden_size" in errors[0] and "optimizer.lrr" in errors[1], res.output
    res = invoke(str(bad), "--json")
    assert res.exit_code == 2
    out = as_json(res)
    assert out["valid"] is False and len(out["load_errors"]) == 2 and out["violations"] == []


def test_a_narrow_terminal_gets_a_line_per_violation_not_a_folded_table() -> None:
    """COLUMNS=40 folded the five columns to strips of a few letters: "MOE01" over "8", keys and fix cut into
    5-letter pieces. Below 80 columns each violation is one line that wraps as prose."""
    r = runner.invoke(app, ["validate-config", "configs/tiny.yaml", "--set", "moe.router_topk=9"],
                      env={"COLUMNS": "40", "MOECTL_DEBUG": ""})  # fmt: skip
    assert r.exit_code == 1
    assert "┃" not in r.output
    one = " ".join(r.output.split())  # the terminal's wrapping undone
    assert ("error: MOE018 moe.router_topk=9, moe.num_experts=4: moe.router_topk=9 must be between 1 and "
            "moe.num_experts=4. fix: set moe.router_topk to 1..4") in one
    wide = runner.invoke(app, ["validate-config", "configs/tiny.yaml", "--set", "moe.router_topk=9"],
                         env={"COLUMNS": "80", "MOECTL_DEBUG": ""})  # fmt: skip
    assert "┃ rule" in wide.output


def test_brackets_in_a_reason_survive_the_table() -> None:
    """Rich read `[vocab_size, hidden_size]` in MOE075's reason as markup and dropped it ("the embedding  would
    hold"): the table's cells are escaped."""
    r = runner.invoke(app, ["validate-config", "configs/tiny.yaml", "--set", "model.vocab_size=36028797018963968"],
                      env={"COLUMNS": "400", "MOECTL_DEBUG": ""})  # fmt: skip
    assert r.exit_code == 1
    assert "the embedding [vocab_size, hidden_size] would hold" in r.output, r.output
    huge = runner.invoke(app, ["validate-config", "configs/tiny.yaml", "--set", "model.vocab_size=2147483648",
                               "--set", "model.hidden_size=2147483648"], env={"COLUMNS": "400", "MOECTL_DEBUG": ""})
    assert "MOE075" in huge.output and "TiB" not in huge.output  # no "memory 5.37e+08 TiB per rank" summary
