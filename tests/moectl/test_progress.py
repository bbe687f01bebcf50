"""The training progress lines (moectl/cli/progress.py): what a log file shows at every step."""

from __future__ import annotations

import io

from rich.console import Console

from moectl.cli.progress import PlainObserver, _clock

RECORD = {"loss": 2.5, "lr": 3e-4, "grad_norm": 1.0, "tokens_per_s": 30000.0}


def test_clock_reads_hours_and_survives_any_eta() -> None:
    assert _clock(125) == "0:02:05" and _clock(-3) == "0:00:00"
    assert _clock(1e16).endswith(" days") and _clock(float("inf")) == "inf days" and _clock(float("nan")) == "?"


def test_a_plain_line_with_an_eta_past_what_timedelta_holds() -> None:
    """`train.train_iters=1e16` passed validation and then crashed the first line with OverflowError."""
    out = io.StringIO()
    obs = PlainObserver(Console(file=out, width=200), log_interval=1)
    with obs.running(total_steps=10**16, start_step=0):
        obs._t0 -= 1.0  # the first step took a second: an ETA of 1e16 s
        obs.step(1, RECORD)
    line = out.getvalue()
    assert "step 1/10000000000000000" in line and "ETA " in line and " days" in line, line
