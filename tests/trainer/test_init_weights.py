"""Skipping the random init when a checkpoint replaces every weight (trainer/init_weights.py)."""

from __future__ import annotations

import threading

import torch

from moectl.core.config.load import load_config
from trainer.build import build_model
from trainer.init_weights import init_skipped, normal_, skipped_init

CPU = torch.device("cpu")


def _model(cfg):  # type: ignore[no-untyped-def]
    return dict(build_model(cfg, CPU).named_parameters())


def test_skipped_init_zeroes_every_random_draw_and_nothing_else_changes() -> None:
    cfg = load_config("configs/tiny.yaml", ["data.source=synthetic"])
    before = _model(cfg)
    with skipped_init():
        skipped = _model(cfg)
    after = _model(cfg)
    random = [n for n, p in before.items() if p.float().std() > 0]  # norms start at ones: not drawn
    assert random and all(not skipped[n].any() for n in random)
    assert all(torch.equal(p, after[n]) for n, p in before.items())  # the seeded init is unchanged after it


def test_the_switch_is_per_thread_and_restored() -> None:
    seen = []
    with skipped_init():
        t = threading.Thread(target=lambda: seen.append(init_skipped()))
        t.start()
        t.join()
        assert init_skipped()
        with skipped_init():
            pass
        assert init_skipped()  # nested exit keeps the outer state
    assert seen == [False] and not init_skipped()
    g = torch.Generator().manual_seed(0)
    assert normal_(torch.empty(4), 1.0, g).std() > 0
