"""Every shipped config loads and breaks no rule at the world size its `# world size: N` comment names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moectl.core import hardware
from moectl.core.config.load import load_config
from moectl.core.rules import Environment, check
from moectl.core.summary import summarize

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
NO_MACHINE = Environment(te=None, device=None)


def world_size(path: Path) -> int:
    m = re.search(r"^# world size: (\d+)\s*$", path.read_text(), re.MULTILINE)
    assert m, f"{path.name}: add a '# world size: N' comment"
    return int(m.group(1))


def test_the_shipped_set() -> None:
    names = {p.name for p in CONFIGS}
    assert {
        "tiny.yaml",
        "mixtral_8x7b_like.yaml",
        "fp8_tensorwise.yaml",
        "mxfp8_param_gather.yaml",
        "nvfp4.yaml",
        "muon_mxfp8.yaml",
        "expert_parallel.yaml",
        "drop_and_pad_cuda_graph.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_valid_at_its_world_size(path: Path) -> None:
    cfg = load_config(path)
    n = world_size(path)
    errors = [v for v in check(cfg, world_size=n, env=NO_MACHINE) if v.severity == "error"]
    assert errors == [], errors
    s = summarize(cfg, n)
    assert s.layout.world_size == n and s.params.total > s.params.active > 0


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("capability", [(9, 0), (10, 0)], ids=["sm90", "sm100"])
def test_config_has_no_errors_on_hopper_or_blackwell(path: Path, capability: tuple[int, int]) -> None:
    cfg = load_config(path)
    if cfg.train.device == "cpu":
        pytest.skip("a CPU config")
    found = check(cfg, world_size=world_size(path), device_capability=capability, env=NO_MACHINE)
    assert [v for v in found if v.severity == "error"] == []
    mp = cfg.mixed_precision  # MOE038 warns exactly where the run emulates (moectl/core/hardware.py)
    recipes = ([(mp.fp8_recipe, mp.fp8)] if mp.fp8 else []) + ([(mp.fp4_recipe, None)] if mp.fp4 else [])
    emulates = any(hardware.emulated_gemms(r, f, capability) for r, f in recipes)
    assert any(v.rule == "MOE038" for v in found) == emulates


def test_tiny_is_the_cpu_default() -> None:
    cfg = load_config(CONFIGS[0].parent / "tiny.yaml")
    assert world_size(CONFIGS[0].parent / "tiny.yaml") == 1
    assert check(cfg, env=NO_MACHINE) == []  # not even a warning
    assert cfg.mixed_precision.fp8 is None and cfg.mixed_precision.fp4 is None and not cfg.train.cuda_graph
    assert cfg.data.source == "corpus"


def test_the_mxfp8_example_is_the_legal_combination() -> None:
    cfg = load_config(CONFIGS[0].parent / "mxfp8_param_gather.yaml")
    mp, par = cfg.mixed_precision, cfg.parallel
    assert (mp.fp8_recipe, mp.fp8_param_gather, mp.reuse_grad_buf_for_mxfp8_param_ag) == ("mxfp8", True, True)
    assert par.overlap_grad_reduce and par.overlap_param_gather and par.use_distributed_optimizer
