"""Quantized param storage (low-precision param gather) on one process: sites, construction, scales, errors.

The whole-run equivalences (layouts, ON vs OFF, 2 ranks) are in tests/acceptance/test_pg_*.py.
"""

from __future__ import annotations

import pytest
import torch

from moectl.core.errors import ConfigError
from acceptance.pg_harness import Knobs, batch, build, config, quantized_params
from trainer.parallel import ParallelState
from trainer.distributed import quantized_storage as qs
from trainer.distributed.param_gather import param_gather_storage
from trainer.distributed.param_sync import ParamSyncState
from trainer.distributed.weight_sites import find_sites, is_placeholder
from trainer.model import GPTMoE
from trainer.precision import get_recipe

PS = ParallelState.trivial("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-expert"])
def test_sites_are_the_block_linears_and_experts_only(grouped: bool) -> None:
    cfg = config(Knobs(recipe="mxfp8", grouped=grouped))
    recipe = get_recipe(cfg.mixed_precision)
    model = GPTMoE(cfg.model, cfg.moe, recipe=recipe, expert_align=recipe.align_size, params_dtype=torch.bfloat16)
    names = {p: n for n, p in model.named_parameters()}
    got = sorted(names[p] for p in find_sites(model))
    experts = ["weight"] if grouped else [f"weight{e}" for e in range(cfg.moe.num_experts)]
    want = sorted(
        [f"decoder.layers.{i}.self_attention.{lin}.weight" for i in (0, 1) for lin in ("linear_qkv", "linear_proj")]
        + [f"decoder.layers.1.mlp.linear_fc{j}.weight" for j in (1, 2)]
        + [f"decoder.layers.0.mlp.experts.linear_fc{j}.{w}" for j in (1, 2) for w in experts]
    )
    assert got == want  # not the embedding, head, norms, router or biases
    plain = GPTMoE(cfg.model, cfg.moe, params_dtype=torch.bfloat16)  # no recipe: nothing to quantize
    assert find_sites(plain) == {}


def test_a_per_expert_site_keeps_its_expert_slot_beside_a_frozen_expert() -> None:
    """A review found the slot counted over the trainable experts only: with expert 1 frozen, expert 2's quantized
    weight was published into slot 1 of the module's [E, out, in]."""
    cfg = config(Knobs(recipe="mxfp8", grouped=False))
    recipe = get_recipe(cfg.mixed_precision)
    model = GPTMoE(cfg.model, cfg.moe, recipe=recipe, expert_align=recipe.align_size, params_dtype=torch.bfloat16)
    fc1 = model.decoder.layers[0].mlp.experts.linear_fc1
    fc1.weight1.requires_grad_(False)
    sites = find_sites(model)
    assert [sites[w].expert for w in fc1.weight_params() if w in sites] == [0, *range(2, cfg.moe.num_experts)]


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-expert"])
def test_construction_masters_from_init_no_copies_live_weights(recipe: str, grouped: bool) -> None:
    ref, _, _ = build(Knobs(recipe=recipe, gather=False, grouped=grouped), PS)
    init = {n: p.detach().float().clone() for n, p in ref.named_parameters()}
    model, engine, _ = build(Knobs(recipe=recipe, grouped=grouped), PS)
    masters = engine.optimizer.gather_logical_state()["params"]
    for name, entry in masters.items():
        assert torch.equal(entry["master"], init[name]), name  # from the init values, not dequantized bytes
    qparams = quantized_params(model)
    assert len(qparams) == (8 if grouped else 14)  # 6 attention/dense + 2 expert linears (x E per-expert)
    names = {p: n for n, p in model.named_parameters()}
    for p in qparams:
        storage = qs.quantized_storage_of(p)
        assert storage is not None and storage.init_values == {}  # freed once masters exist
        assert is_placeholder(p.data) and bool(p.isnan().all())  # no high-precision copy; a stray read is NaN
        assert storage.matches_master(p, masters[names[p]]["master"]), names[p]
        if recipe in ("tensorwise", "delayed", "blockwise"):  # built at its first backward use, from the bytes
            assert storage.live(p).columnwise is None and storage.live(p).with_columnwise().columnwise is not None
        else:  # quantized from the gathered high-precision values, both copies at once
            assert storage.live(p).columnwise is not None
    for n, p in model.named_parameters():
        if qs.quantized_storage_of(p) is None:
            assert not is_placeholder(p.data) and torch.equal(p.detach().float(), init[n]), n
    assert {g.state for g in engine.dmodel.bucket_groups} <= {ParamSyncState.IDLE, ParamSyncState.POST_PROCESSED}
    with pytest.raises(RuntimeError):  # a write to a placeholder fails loudly (all elements share one)
        with torch.no_grad():
            qparams[0].copy_(torch.zeros(qparams[0].shape))


def test_one_amax_all_reduce_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    model, engine, _ = build(Knobs(recipe="tensorwise"), PS)
    calls = []
    real = qs.comm.all_reduce
    def spy(t: torch.Tensor, g: object, **kw: object) -> object:
        if kw.get("op") == torch.distributed.ReduceOp.MAX:  # the grad norm's SUM all-reduce is not an amax
            calls.append(t.numel())
        return real(t, g, **kw)

    monkeypatch.setattr(qs.comm, "all_reduce", spy)
    for step in range(2):
        engine.zero_grad()
        tokens = batch(step, 0, 0)
        model.loss(tokens[:, :-1], tokens[:, 1:]).total.backward()
        engine.step(1e-3)
    # dense and expert params share the dp ranks here: one all-reduce covers all 2 + 2 + 2 + 4 + 4 scales
    assert calls == [14, 14]


def test_blockwise_one_all_reduce_of_every_block_amax_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blockwise: one MAX all-reduce per step carries the amax of every 128x128 block of every quantized
    weight (qkv [256, 128]: 2 blocks; proj [128, 128]: 1; dense fc1 [256, 128]: 2, fc2 [128, 128]: 1; expert
    fc1 [4, 256, 128]: 8, fc2 [4, 128, 128]: 4), and the live weights are the recipe's quantization of the
    masters after it."""
    model, engine, _ = build(Knobs(recipe="blockwise"), PS)
    calls = []
    real = qs.comm.all_reduce

    def spy(t: torch.Tensor, g: object, **kw: object) -> object:
        if kw.get("op") == torch.distributed.ReduceOp.MAX:
            calls.append(t.numel())
        return real(t, g, **kw)

    monkeypatch.setattr(qs.comm, "all_reduce", spy)
    for step in range(2):
        engine.zero_grad()
        tokens = batch(step, 0, 0)
        model.loss(tokens[:, :-1], tokens[:, 1:]).total.backward()
        engine.step(1e-3)
    assert calls == [2 * (2 + 1) + 2 + 1 + 8 + 4] * 2
    masters = engine.optimizer.gather_logical_state()["params"]
    names = {p: n for n, p in model.named_parameters()}
    for p in quantized_params(model):
        assert qs.quantized_storage_of(p).matches_master(p, masters[names[p]]["master"]), names[p]


def test_per_tensor_staging_needs_agreed_scales() -> None:
    model, engine, _ = build(Knobs(recipe="tensorwise"), PS)
    storage = qs.quantized_storage_of(quantized_params(model)[0])
    group = next(g for g in engine.dmodel.bucket_groups if g.storage is storage)
    storage.scales.clear()
    with pytest.raises(RuntimeError, match="prepare_stage"):
        storage.stage(group.buckets[0], 0, group.buckets[0].numel, torch.zeros(group.buckets[0].numel))


def test_stale_scales_are_never_staged() -> None:
    """Masters that changed since the last prepare_stage get fresh scales before any group stages."""
    model, engine, _ = build(Knobs(recipe="tensorwise"), PS)
    opt = engine.optimizer
    for s in opt.shards:
        s.master.mul_(4.0)  # as a step or a checkpoint load would
    opt._master_version += 1
    for g in opt.groups:
        g.stage()
    engine.dmodel.start_param_sync(force_sync=True)
    masters = opt.gather_logical_state()["params"]
    names = {p: n for n, p in model.named_parameters()}
    for p in quantized_params(model):
        assert qs.quantized_storage_of(p).matches_master(p, masters[names[p]]["master"]), names[p]


@pytest.mark.parametrize("recipe", ["rowwise"])
def test_recipes_without_a_param_gather_are_refused(recipe: str) -> None:
    cfg = config(Knobs(recipe="tensorwise"))
    cfg.mixed_precision.fp8_recipe = recipe
    r = get_recipe(cfg.mixed_precision)
    cfg.model.hidden_size = cfg.moe.ffn_hidden_size = cfg.model.ffn_hidden_size = 128
    model = GPTMoE(cfg.model, cfg.moe, recipe=r, expert_align=r.align_size)
    with pytest.raises(ConfigError, match="MOE048"):
        param_gather_storage(model, cfg.mixed_precision, r)
    plain = GPTMoE(cfg.model, cfg.moe)
    with pytest.raises(ConfigError, match="no weight"):
        param_gather_storage(plain, cfg.mixed_precision, get_recipe(config(Knobs(recipe="tensorwise")).mixed_precision))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise", "mxfp8", "nvfp4"])
def test_matches_master_catches_a_changed_byte_or_master(recipe: str) -> None:
    """The checkpoint validator's param check: live bytes vs the recipe's quantization of the master."""
    model, engine, _ = build(Knobs(recipe=recipe, grouped=False), PS)
    masters = engine.optimizer.gather_logical_state()["params"]
    names = {p: n for n, p in model.named_parameters()}
    p = next(q for q in quantized_params(model) if ".experts." in names[q])  # a per-expert slice of [E, out, in]
    storage = qs.quantized_storage_of(p)
    master = masters[names[p]]["master"]
    assert storage.matches_master(p, master)
    assert not storage.matches_master(p, master * 1.5)
    data = storage.live(p).rowwise.data.view(torch.uint8)
    data.view(-1)[3] ^= 1  # one bit of one byte
    assert not storage.matches_master(p, master)


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_bare_params_by_name(recipe: str) -> None:
    """Benchmarks hold parameters without their layers: the storage holds their quantized values itself."""
    from moectl.bench.param_mix import MixShape, build_params
    from moectl.core.config.schema import ParallelConfig
    from trainer.distributed import DistributedModel
    from trainer.distributed.param_gather import is_block_linear, storage_by_name
    from trainer.optim.distributed_optimizer import DistributedOptimizer

    mp = config(Knobs(recipe=recipe)).mixed_precision
    module = build_params(MixShape.quick(), torch.device("cpu"), torch.bfloat16)
    dm = DistributedModel(module, ParallelConfig(bucket_size=20_000), PS, storage=storage_by_name(get_recipe(mp), mp))
    opt = DistributedOptimizer(dm, config(Knobs()).optimizer)
    masters = opt.gather_logical_state()["params"]
    quantized = {n for n, p in module.named_parameters() if qs.quantized_storage_of(p) is not None}
    assert quantized == {n for n, _ in module.named_parameters() if is_block_linear(n)} and len(quantized) == 8
    for n, p in module.named_parameters():
        if n in quantized:
            assert qs.quantized_storage_of(p).matches_master(p, masters[n]["master"]), n
    assert not is_block_linear("decoder.layers.0.mlp.experts.linear_fc1.bias0")
    assert is_block_linear("decoder.layers.0.mlp.experts.linear_fc1.weight3")


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-expert"])
def test_one_quantize_call_per_param_after_the_gather(grouped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A single grouped [E, out, in] weight is quantized in one call, not a per-expert loop (seed 000)."""
    model, engine, _ = build(Knobs(recipe="mxfp8", grouped=grouped), PS)
    recipe = model.recipe
    shapes: list[tuple[int, ...]] = []
    real = type(recipe).quantize_weight
    def spy(self: object, w: torch.Tensor, **kw: object) -> object:
        shapes.append(tuple(w.shape))
        return real(self, w, **kw)

    monkeypatch.setattr(type(recipe), "quantize_weight", spy)
    for g in engine.optimizer.groups:
        g.stage()
    engine.dmodel.force_param_sync()
    experts = [s for s in shapes if len(s) == 3]
    assert len(shapes) == (8 if grouped else 14)
    assert len(experts) == (2 if grouped else 0)  # fc1 and fc2, each [E, out, in] at once
