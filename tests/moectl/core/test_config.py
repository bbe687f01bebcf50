"""The config loader: YAML + `--set` overrides -> a typed Config, with readable one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moectl.core.config import Config, config_from_dict, dump_config
from moectl.core.config.load import load_config
from moectl.core.config.load import _Loader, parse_override, read_yaml
from moectl.core.errors import ConfigError, MoectlError, UsageError

REPO = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_without_a_file() -> None:
    cfg = load_config(None)
    assert isinstance(cfg, Config)
    assert cfg.moe.num_experts == 4 and cfg.optimizer.optimizer == "adam"


def test_yaml_values_land_in_their_sections(tmp_path: Path) -> None:
    p = write(tmp_path, "model:\n  num_layers: 3\nmoe:\n  router_topk: 1\noptimizer:\n  lr: 3e-4\n")
    cfg = load_config(p)
    assert cfg.model.num_layers == 3 and cfg.moe.router_topk == 1
    # YAML 1.1 would read 3e-4 as a string; moectl's loader reads it as the float a user means.
    assert cfg.optimizer.lr == pytest.approx(3e-4) and isinstance(cfg.optimizer.lr, float)


@pytest.mark.parametrize(
    "item, path, value",
    [
        ("optimizer.lr=3e-4", ["optimizer", "lr"], 3e-4),
        ("optimizer.lr=1E-3", ["optimizer", "lr"], 1e-3),
        ("moe.glu_interleave_size=null", ["moe", "glu_interleave_size"], None),
        ("moe.glu_interleave_size=", ["moe", "glu_interleave_size"], None),
        ("model.moe_layer_freq=[1, 0, 1]", ["model", "moe_layer_freq"], [1, 0, 1]),
        ("mixed_precision.bf16=true", ["mixed_precision", "bf16"], True),
        ("run_dir=runs/x", ["run_dir"], "runs/x"),
        ("data.path=a=b", ["data", "path"], "a=b"),  # only the first '=' splits
    ],
)
def test_set_values_are_yaml_scalars(item: str, path: list[str], value: object) -> None:
    assert parse_override(item) == (path, value)


def test_set_overrides_apply_in_order_over_the_file(tmp_path: Path) -> None:
    p = write(tmp_path, "optimizer:\n  lr: 1.0e-3\n")
    cfg = load_config(
        p, ["optimizer.lr=3e-4", "moe.capacity_factor=1.25", "model.moe_layer_freq=[1, 0]", "optimizer.lr=2e-4"]
    )
    assert cfg.optimizer.lr == pytest.approx(2e-4)
    assert cfg.moe.capacity_factor == 1.25
    assert cfg.model.moe_layer_freq == [1, 0]


def test_set_null_resets_an_optional_key(tmp_path: Path) -> None:
    p = write(tmp_path, "moe:\n  capacity_factor: 1.5\n")
    assert load_config(p, ["moe.capacity_factor=null"]).moe.capacity_factor is None


def test_int_widens_to_float() -> None:
    cfg = load_config(None, ["optimizer.lr=1"])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


@pytest.mark.parametrize(
    "override, key, suggestion",
    [
        ("moe.num_expert=8", "moe.num_expert", "num_experts"),
        ("mdoel.num_layers=2", "mdoel", "model"),
        ("optimizer.learning_rate=1e-3", "optimizer.learning_rate", "valid keys"),
    ],
)
def test_unknown_key_is_an_error_with_did_you_mean(override: str, key: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    line = err.value.one_line()
    assert line.startswith(key) and "unknown key" in line and suggestion in line
    assert err.value.exit_code == 2


def test_unknown_key_in_a_file_names_its_dotted_path(tmp_path: Path) -> None:
    p = write(tmp_path, "parallel:\n  expert_parallel_size: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert err.value.one_line() == (
        "parallel.expert_parallel_size=2: unknown key. fix: did you mean 'expert_model_parallel_size'?"
    )


@pytest.mark.parametrize(
    "override, key, value, expected",
    [
        ("moe.num_experts=three", "moe.num_experts", "'three'", "int"),
        ("moe.num_experts=2.5", "moe.num_experts", "2.5", "int"),
        ("model.num_layers=true", "model.num_layers", "true", "int"),  # a bool is not an int (YAML spelling)
        ("moe.router_topk=", "moe.router_topk", "null", "int"),  # an empty value is null, said as YAML says it
        ("mixed_precision.bf16=1", "mixed_precision.bf16", "1", "bool"),
        ("mixed_precision.fp8_recipe=mxfp9", "mixed_precision.fp8_recipe", "'mxfp9'", "'mxfp8'"),
        ("moe.capacity_factor=high", "moe.capacity_factor", "'high'", "float | null"),
        ("model.moe_layer_freq=[1, x]", "model.moe_layer_freq", "[1, 'x']", "list[int]"),
    ],
)
def test_type_error_names_key_value_and_expected_type(override: str, key: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    line = err.value.one_line()
    assert line.startswith(f"{key}={value}:"), line
    assert "expected" in line and expected in line and "fix:" in line
    assert "\n" not in line



def test_an_integral_float_for_an_int_key_is_told_how_to_write_it() -> None:
    """`train.train_iters=1e3` is the float 1000.0 to YAML: the fix writes the integer, not just the type."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.train_iters=1e3"])
    assert "fix: write train.train_iters as the integer 1000 " in err.value.one_line()
    with pytest.raises(ConfigError) as err:  # a fraction keeps the plain type fix
        load_config(None, ["moe.num_experts=2.5"])
    assert "write moe.num_experts" not in err.value.one_line()

def test_section_given_a_scalar_is_an_error() -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(None, ["model=3"])


def test_set_without_equals_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="KEY=VALUE") as err:
        load_config(None, ["optimizer.lr"])
    assert err.value.exit_code == 2


@pytest.mark.parametrize("item", ["=3", " =3", "moe..router_topk=2", ".lr=1"])
def test_set_with_no_key_names_the_item(item: str) -> None:
    """`--set =3` said only "unknown key", naming nothing."""
    with pytest.raises(UsageError, match="no key before '='") as err:
        load_config(None, [item])
    assert repr(item) in err.value.one_line()


def test_set_with_a_mapping_value_is_refused() -> None:
    with pytest.raises(UsageError, match="scalar"):
        load_config(None, ["model={num_layers: 2}"])


def test_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not found") as err:
        load_config(tmp_path / "nope.yaml")
    assert err.value.exit_code == 2


def test_bad_yaml_names_line_and_column(tmp_path: Path) -> None:
    p = write(tmp_path, "model:\n  num_layers: 2\n  hidden_size: [64\n")
    with pytest.raises(UsageError, match=r"not valid YAML at line \d+, column \d+") as err:
        load_config(p)
    assert err.value.exit_code == 2
    assert "\n" not in err.value.one_line()


def test_top_level_list_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="mapping"):
        read_yaml(write(tmp_path, "- a\n- b\n"))


def test_empty_file_is_the_defaults(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="is empty"):
        assert load_config(write(tmp_path, "")) == Config()


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config(
        REPO / "configs" / "tiny.yaml",
        ["model.moe_layer_freq=[1, 0]", "optimizer.adam_eps=1e-8", "moe.capacity_factor=1.25", "data.path=x.bin"],
    )
    text = dump_config(cfg)
    again = load_config(write(tmp_path, text, "dumped.yaml"))
    assert again == cfg
    # every section is written out in full, so the dump is the whole resolved config
    assert set(yaml.safe_load(text)) == {f for f in Config.__dataclass_fields__}


def test_config_from_dict_matches_load_config(tmp_path: Path) -> None:
    data = {"moe": {"num_experts": 8, "router_topk": 2}, "train": {"cuda_graph": True}}
    assert config_from_dict(data) == load_config(write(tmp_path, yaml.safe_dump(data)))


def test_errors_are_moectl_errors() -> None:
    # the CLI turns exactly these into one line + exit code; anything else keeps its traceback
    with pytest.raises(MoectlError):
        load_config(None, ["moe.nope=1"])


@pytest.mark.parametrize(
    "text, key, lines",
    [
        ("moe:\n  num_experts: 8\ntrain:\n  seed: 1\nmoe:\n  router_topk: 1\n", "moe", (1, 5)),  # issue 18
        ("moe:\n  num_experts: 8\n  router_topk: 1\n  num_experts: 2\n", "num_experts", (2, 4)),
        ("run_dir: a\nrun_dir: b\n", "run_dir", (1, 2)),
    ],
)
def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path: Path, text: str, key: str, lines: tuple) -> None:
    with pytest.raises(UsageError) as e:
        load_config(write(tmp_path, text))
    msg = e.value.one_line()
    assert f"key {key!r} appears twice (lines {lines[0]} and {lines[1]})" in msg and "\n" not in msg
    assert e.value.exit_code == 2


def test_a_yaml_merge_is_not_a_duplicate(tmp_path: Path) -> None:
    text = "model: &m\n  num_layers: 3\nmoe:\n  num_experts: 8\n"
    assert load_config(write(tmp_path, text)).model.num_layers == 3
    anchored = "x: &base {num_layers: 3}\n"  # an anchor merged into a section overrides on purpose
    data = yaml.load(anchored + "model:\n  <<: *base\n  num_layers: 4\n", Loader=_Loader)
    assert data["model"] == {"num_layers": 4}


def test_a_config_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    p = tmp_path / "latin1.yaml"
    p.write_bytes("model:\n  num_layers: 2  # café\n".encode("latin-1"))
    with pytest.raises(UsageError) as e:
        load_config(p)
    assert e.value.one_line() == (
        f"{p}: not UTF-8 text: byte 0xe9 at line 2, column 23. fix: save the file as UTF-8"
    )
    p.write_bytes(b"\xef\xbb\xbf" + "model:\n  num_layers: 3  # café\n".encode())  # a BOM is fine
    assert load_config(p).model.num_layers == 3


def test_every_bad_key_and_value_of_a_file_is_reported_at_once(tmp_path: Path) -> None:
    """Four mistakes, one round trip: each its own line, in file order; a mistyped section is named without
    its contents (it used to print the whole section)."""
    long = ", ".join(str(i) for i in range(40))
    p = write(tmp_path, f"model:\n  hidden_size: sixtyfour\nmoe:\n  router_topk_: 2\noptimizer:\n  lrr: 0.1\n"
                        f"moee:\n  b: [{long}]\n")  # fmt: skip
    with pytest.raises(ConfigError) as err:
        load_config(p)
    lines = err.value.lines()
    assert [line.split("=")[0] for line in lines[:3]] == ["model.hidden_size", "moe.router_topk_", "optimizer.lrr"]
    assert lines[3].startswith("moee (a section): unknown key")
    assert "did you mean 'router_topk'" in lines[1] and "did you mean 'lr'" in lines[2]
    assert "did you mean 'moe'" in lines[3] and len(lines[3]) < 160 and "39" not in lines[3]
    assert err.value.exit_code == 2 and "4 config errors" in err.value.one_line()
    with pytest.raises(ConfigError) as one:  # a single mistake stays a plain one-line ConfigError
        load_config(None, ["optimizer.lrr=0.1"])
    assert one.value.lines() == [one.value.one_line()]


def test_a_folder_given_as_the_config_says_so(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="is a folder, not a YAML file"):
        load_config(tmp_path)


def test_a_device_or_a_looping_link_given_as_the_config_says_which(tmp_path: Path) -> None:
    """Both said "not found", though /dev/null exists and a link loop is a link."""
    with pytest.raises(UsageError, match="'/dev/null' is not a regular file"):
        load_config("/dev/null")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(UsageError, match="is a symbolic link that leads nowhere"):
        load_config(tmp_path / "a")
    with pytest.raises(UsageError, match="not found"):
        load_config(tmp_path / "nothing.yaml")


def test_a_mistyped_section_is_named_without_its_contents(tmp_path: Path) -> None:
    """`mo:` for `moe:` printed the whole section: `mo={'num_experts': 4, ...: unknown key`."""
    p = write(tmp_path, "mo:\n  num_experts: 4\n  router_topk: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert err.value.one_line() == "mo (a section): unknown key. fix: did you mean 'moe'?"


def test_several_errors_are_the_exceptions_own_text_too(tmp_path: Path) -> None:
    """`str(e)` (tracebacks under MOECTL_DEBUG, pytest's match) holds every error, not the first one."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["optimizer.lrr=1", "moe.topk=2"])
    assert "optimizer.lrr" in str(err.value) and "moe.topk" in str(err.value)
    assert str(err.value) == err.value.message and err.value.key == "optimizer.lrr"


def test_an_empty_config_file_warns_that_everything_is_default(tmp_path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.warns(UserWarning, match="is empty: every key takes its default"):
        load_config(empty)
