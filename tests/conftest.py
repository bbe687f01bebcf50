"""Shared test settings: GPU tests are skipped cleanly where CUDA is absent (they run on the device tool)."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread for the test: tiny GEMMs, where thread start-up dominates and the CI box's 2 cores are
    shared by several runs (modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def signal_handlers_restored() -> Iterator[None]:
    """Each test starts with the handlers of SIGINT, SIGTERM and SIGHUP the one before it found. A command run in
    this process may leave them ignored as a process that is ending does (`moectl.cli.launch`'s late signals),
    and an ignored signal is inherited by every child a later test starts."""
    import signal

    from moectl.core.stop_signals import STOP_SIGNALS

    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    yield
    for s, handler in saved.items():
        if handler is not None and signal.getsignal(s) is not handler:
            signal.signal(s, handler)
