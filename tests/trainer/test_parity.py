"""`trainer.parity`: lockstep runs see what they would alone; the comparison's bitwise and rtol rules."""

import math

import pytest
import torch

from moectl.core.config.load import load_config
from moectl.core.errors import ConfigError
from trainer.loop import Trainer
from trainer.observer import SilentObserver
from trainer.parity import compare_scalar, compare_states, compare_tensor, kind_of, run_parity

FAST = [
    "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=16", "moe.ffn_hidden_size=16", "train.micro_batch_size=2", "train.global_batch_size=4",
    "data.source=synthetic", "train.eval_interval=null", "train.train_iters=3", "train.device=cpu",
]  # fmt: skip


def cfg(*extra: str):
    return load_config(None, [*FAST, *extra])


def test_each_side_trains_as_it_would_alone(tmp_path):
    """Lockstep with per-side RNG states: OFF's and ON's losses are those of each config run on its own."""
    off, on = cfg(f"run_dir={tmp_path / 'a'}"), cfg(f"run_dir={tmp_path / 'b'}", "optimizer.lr=1e-3")
    report = run_parity(off, on, 3, flags=["optimizer.lr=1e-3"])
    assert not (tmp_path / "a").exists()  # parity writes nothing into run_dir
    assert [r.off.loss for r in report.records] == Trainer(off, SilentObserver()).run().losses
    assert [r.on.loss for r in report.records] == Trainer(on, SilentObserver()).run().losses
    assert not report.equal and report.first.step == 1 and report.first.what == "param"


def test_a_tolerance_accepts_what_bitwise_rejects():
    off, on = cfg(), cfg("optimizer.lr=0.0030000001")  # an lr one part in 3e7 away
    assert not run_parity(off, on, 2).equal
    assert run_parity(off, on, 2, rtol=1e-4).equal


def test_flags_that_change_the_parameters_are_refused_before_anything_runs(monkeypatch):
    import trainer.parity as parity

    monkeypatch.setattr(parity, "_Run", None)  # nothing may be built
    with pytest.raises(ConfigError) as err:
        run_parity(cfg(), cfg("moe.num_experts=8"), 1, flags=["moe.num_experts=8"])
    line = err.value.one_line()
    assert line.startswith("--flag='moe.num_experts=8': changes the model's parameters (") and "expert weights" in line
    assert "router" in line and "parity compares one model run two ways" in line


def test_flags_that_keep_the_parameters_pass_that_check():
    from trainer.parity import _same_parameters

    for flag in ("moe.single_grouped_weight=false", "mixed_precision.bf16=true", "moe.router_topk=1",
                 "moe.backend=loop", "parallel.overlap_grad_reduce=true"):
        _same_parameters(cfg(), cfg(flag), [flag])


def test_steps_beyond_the_schedule_are_refused():
    with pytest.raises(ConfigError, match="train.train_iters=3"):
        run_parity(cfg(), cfg(), 4)


def test_scalar_and_tensor_rules():
    assert compare_scalar(1.0, 1.0, None) is None and compare_scalar(math.nan, math.nan, None) is None
    assert "relative 1.000e-06" in compare_scalar(1.0, 1.000001, None)
    assert compare_scalar(1.0, 1.000001, 1e-5) is None and compare_scalar(1.0, 1.0001, 1e-5) is not None
    assert compare_scalar(1.0, math.inf, 1.0) is not None
    a = torch.tensor([1.0, 2.0, float("nan")])
    assert compare_tensor(a, a.clone(), None) is None  # same bits, NaN included
    assert compare_tensor(a, a.to(torch.float64), None).startswith("dtype")
    b = torch.tensor([1e-9, 4.0])
    c = torch.tensor([2e-9, 4.0])  # near zero, a large relative but tiny absolute change
    assert compare_tensor(b, c, 1e-6) is None and "1 of 2 elements" in compare_tensor(b, c, None)
    # the magnitude is named as one, and the ratio as the ratio (it printed the ratio as "max |off|")
    assert "max |diff| 1.000e+00 (max |off| 4.000e+00, relative 2.500e-01)" in compare_tensor(
        torch.tensor([4.0, 1.0]), torch.tensor([4.0, 2.0]), None)
    assert compare_tensor(b, torch.tensor([1e-9, 4.1]), 1e-3) is not None
    assert compare_tensor(b, torch.zeros(3), 1.0).startswith("shape")


def test_state_differences_in_comparison_order():
    off = {"b.weight": torch.zeros(2), "b.weight.main_param": torch.zeros(2), "a.weight.exp_avg": torch.zeros(2)}
    on = {"b.weight": torch.ones(2), "b.weight.main_param": torch.ones(2), "a.weight.exp_avg": torch.ones(2),
          "c.weight": torch.zeros(1)}
    got = [(d.what, d.name) for d in compare_states(4, off, on, None)]
    assert got == [("param", "c.weight"), ("param", "b.weight"), ("master", "b.weight.main_param"),
                   ("exp_avg", "a.weight.exp_avg")]
    assert kind_of("x.weight.momentum_buffer") == "momentum_buffer"


def test_non_finite_entries_must_match():
    a = torch.tensor([1.0, float("inf"), float("nan")])
    assert compare_tensor(a, a.clone(), 1e-3) is None
    assert compare_tensor(a, torch.tensor([1.0, float("-inf"), float("nan")]), 1e-3).startswith("non-finite")
    assert compare_tensor(a, torch.tensor([1.0, 5.0, float("nan")]), 1.0).startswith("non-finite")
    assert compare_tensor(torch.tensor([0.0]), torch.tensor([-0.0]), None).startswith("equal values in other bits")
