"""The seeds' matrix (Megatron PR 5464, seed 000), one process: single grouped expert weights equal
per-expert weights, bitwise (losses every step; masters, main grads and effective weights at the end), for
{bf16, fp8 tensorwise, mxfp8, nvfp4} x param gather {on, off} x grad-accumulation fusion {on, off}; and
param gather ON equals OFF bitwise for each (bf16: the distributed optimizer's bf16 gather vs plain DDP;
OFF with the recipe weights in buffers laid out as ON's, the default: see `param_gather_storage`).

World size 1 is enough for layout parity and the storage path (placeholders, staging, quantize after
the gather, the aliased staging buffer); the 2-rank gather properties are in test_pg_dist.py.
"""

from __future__ import annotations

import pytest
import torch

from pg_harness import Knobs, differences, train
from trainer.parallel import ParallelState


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused-wgrad"])
@pytest.mark.parametrize("recipe", ["bf16", "tensorwise", "mxfp8", "nvfp4"])
def test_single_grouped_equals_per_expert_with_and_without_param_gather(recipe: str, fuse: bool) -> None:
    ps = ParallelState.trivial("cpu")
    runs = {(g, grouped): train(Knobs(recipe=recipe, gather=g, grouped=grouped, fuse=fuse), ps)
            for g in (True, False) for grouped in (True, False)}  # fmt: skip
    for gather in (True, False):
        diff = differences(runs[gather, True], runs[gather, False])
        assert not diff, f"{recipe} gather={gather} fuse={fuse}: single grouped != per-expert: {diff}"
    diff = differences(runs[True, True], runs[False, True])
    assert not diff, f"{recipe} fuse={fuse}: param gather ON != OFF: {diff}"
    on = runs[True, True]
    assert len(set(on.losses)) == len(on.losses) and len(on.masters) > 10  # it trained, and compared something
    if recipe != "bf16":
        assert len(on.history) == on.knobs.steps
