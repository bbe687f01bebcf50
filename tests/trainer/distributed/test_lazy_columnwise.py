"""Per-tensor FP8 param gather publishes rowwise only; the columnwise copy is built at its first use.

One process (the publication and caching logic does not depend on the rank count; 2-rank runs are in
test_dist_coalesced.py and tests/acceptance): after every gather each quantized weight is a NEW rowwise-only
QuantizedTensor; the first forward that needs a dgrad builds its columnwise copy once (not once per
micro-batch; never in a no-grad eval), and that copy is bitwise the transpose of the bytes the forward
used; per-expert weights are published with one copy per module, not one per expert; and training with
two micro-batches equals quantizing every forward (param gather off) bitwise over several steps in both
expert layouts, which a columnwise copy left over from an earlier step would break.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from acceptance.pg_harness import Knobs, batch, build, differences, quantized_params, train
from trainer.parallel import ParallelState
from trainer.distributed import quantized_storage as qs
from trainer.distributed import weight_sites
from trainer.precision import QuantizedTensor
from trainer.precision.blocks import transposed

PS = ParallelState.trivial("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _live_weights(model: torch.nn.Module) -> dict[str, QuantizedTensor]:
    """Every published quantized weight by module name (a per-expert layout's module holds one [E, out, in])."""
    return {n: m.quantized_weight for n, m in model.named_modules()
            if getattr(m, "quantized_weight", None) is not None}  # fmt: skip


def _step(model: Any, engine: Any, step: int, n_micro: int, between: Any = None) -> None:
    engine.zero_grad()
    for micro in range(n_micro):
        tokens = batch(step, 0, micro)
        with engine.micro_batch(is_last=micro == n_micro - 1):
            (model.loss(tokens[:, :-1], tokens[:, 1:]).total / n_micro).backward()
    if between is not None:
        between()
    engine.step(3e-3)


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[QuantizedTensor]:
    """Every QuantizedTensor whose columnwise copy `with_columnwise` built (activations and grads included)."""
    seen: list[QuantizedTensor] = []
    real = QuantizedTensor.with_columnwise

    def spy(self: QuantizedTensor) -> QuantizedTensor:
        if self.columnwise is None:
            seen.append(self)
        return real(self)

    monkeypatch.setattr(QuantizedTensor, "with_columnwise", spy)
    return seen


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-expert"])
def test_columnwise_built_once_per_step_at_first_use(recipe: str, grouped: bool,
                                                     builds: list[QuantizedTensor]) -> None:  # fmt: skip
    model, engine, _ = build(Knobs(recipe=recipe, grouped=grouped), PS)
    live = _live_weights(model)
    assert len(live) == 8  # qkv, proj x 2 layers, dense fc1, fc2, expert fc1, fc2 ([E, out, in] either layout)
    assert builds == [] and all(qt.columnwise is None for qt in live.values())  # the gather built none
    held = []  # keep every published object alive: a new one can never reuse an old one's id
    for step in range(3):
        before = _live_weights(model)
        held.append(before)
        builds.clear()
        checked: dict[str, bool] = {}

        def check() -> None:  # after the backward of every micro-batch, before the step's gather
            for name, qt in _live_weights(model).items():
                assert qt is before[name], name  # the step's forwards read one published object each
                cw = qt.copy("columnwise").data.view(torch.uint8)
                checked[name] = torch.equal(cw, transposed(qt.rowwise.data).view(torch.uint8))

        _step(model, engine, step, n_micro=3, between=check)
        weights = [qt for qt in builds if any(qt is w for w in before.values())]
        assert len(weights) == 8 and len({id(w) for w in weights}) == 8  # once per weight and step, on the
        # published object itself (cached there for the other micro-batches), not once per micro-batch
        assert checked and all(checked.values()), checked
        after = _live_weights(model)
        assert all(after[n] is not before[n] and after[n].columnwise is None for n in after)  # new, rowwise only
    builds.clear()
    engine.sync_params_for_eval()
    with torch.no_grad():
        tokens = batch(99, 0, 0)
        model.loss(tokens[:, :-1], tokens[:, 1:])
    assert builds == []  # a no-grad forward never needs one


def test_per_expert_weights_are_published_per_module(monkeypatch: pytest.MonkeyPatch) -> None:
    model, engine, cfg = build(Knobs(recipe="tensorwise", grouped=False), PS)
    calls: dict[str, list[int]] = {"publish": [], "publish_experts": []}
    real_one, real_many = weight_sites.publish, weight_sites.publish_experts

    def one(site: Any, qt: Any) -> None:
        calls["publish"].append(1 if site.expert is None else 0)
        real_one(site, qt)

    def many(site: Any, experts: torch.Tensor, *a: Any) -> None:
        calls["publish_experts"].append(experts.numel())
        real_many(site, experts, *a)

    monkeypatch.setattr(qs, "publish", one)
    monkeypatch.setattr(qs, "publish_experts", many)
    for g in engine.optimizer.groups:
        g.stage()
    engine.dmodel.force_param_sync()
    E = cfg.moe.num_experts
    assert calls["publish"] == [1] * 6  # the Linear sites, one each; never an expert
    assert sorted(calls["publish_experts"]) == [E, E]  # fc1 and fc2: all E experts in one call each
    masters = engine.optimizer.gather_logical_state()["params"]
    names = {p: n for n, p in model.named_parameters()}
    for p in quantized_params(model):  # each expert's slice of its module's weight is its master's quantization
        assert qs.quantized_storage_of(p).matches_master(p, masters[names[p]]["master"]), names[p]


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-expert"])
def test_two_micro_batches_equal_quantizing_every_forward(grouped: bool) -> None:
    """A stale columnwise copy (from an earlier step's values) changes dgrad, hence every earlier layer's
    weight grad and the masters: ON == OFF bitwise over 4 steps rules it out, in both layouts."""
    k = Knobs(recipe="tensorwise", grouped=grouped, steps=4, n_micro=2, eval_after=(1,))
    on, off = train(k, PS), train(Knobs(**{**k.__dict__, "gather": False}), PS)
    assert differences(on, off) == []
    assert all(not torch.equal(on.history[i], on.history[i - 1]) for i in range(1, len(on.history)))


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-expert"])
def test_published_decode_scales_start_on_16_bytes(grouped: bool) -> None:
    """cuBLASLt takes a published weight's decode scale as its scale pointer and refuses one that does not
    start on 16 bytes (CUBLAS_STATUS_NOT_SUPPORTED on an H200): every published scale and every data view
    must be aligned, after the first gather and after a step's."""
    model, engine, _ = build(Knobs(recipe="tensorwise", grouped=grouped), PS)
    for step in range(2):
        live = _live_weights(model)
        assert len(live) == 8
        for name, qt in live.items():
            assert qt.rowwise.scale.data_ptr() % 16 == 0, (step, name, qt.rowwise.scale.data_ptr() % 16)
            assert qt.rowwise.data.data_ptr() % 16 == 0, (step, name)
        _step(model, engine, step, n_micro=1)
