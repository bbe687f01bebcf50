"""`train.compile=regional`: the compiled norms, attention core and routers train like eager.

The CPU tests compile with backend `aot_eager` (Dynamo capture + AOTAutograd's joint forward/backward graphs,
no code generation): inductor's C++ build takes about 20 s per graph on a cold 2-core CPU. What they prove is
the part that can break composition: graph capture of each region, grads through the compiled graphs into
the distributed wrapper's buffers (its param and module hooks on), no per-layer recompiles. The GPU test runs
inductor itself.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from moectl.core.config.load import load_config
from trainer.compile import BACKEND_ENV, compile_regions, wants_compile
from trainer.loop import Trainer
from trainer.observer import SilentObserver

SMALL = [
    "model.num_layers=3", "model.hidden_size=32", "model.num_attention_heads=4", "model.num_query_groups=2",
    "model.seq_length=32", "model.vocab_size=256", "model.qk_layernorm=true", "model.moe_layer_freq=[0,1,1]",
    "moe.num_experts=4", "moe.ffn_hidden_size=16", "train.micro_batch_size=2", "train.global_batch_size=4",
    "train.eval_interval=null", "data.source=synthetic", "optimizer.lr_warmup_iters=0", "optimizer.lr=1e-2",
    # the distributed optimizer with both overlaps: grad hooks on params, param-gather pre-hooks on modules
    "parallel.use_distributed_optimizer=true", "parallel.overlap_grad_reduce=true",
    "parallel.overlap_param_gather=true",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _state(t: Trainer) -> dict[str, torch.Tensor]:
    t.engine.sync_params_for_eval()
    return {k: v.detach().float().clone() for k, v in t.model.state_dict().items()}


def _train(tmp_path, steps: int, *extra: str) -> tuple[list[float], dict[str, torch.Tensor], Trainer]:
    cfg = load_config(None, [*SMALL, f"run_dir={tmp_path}", *extra])
    t = Trainer(cfg, SilentObserver())
    t.initial_state = _state(t)  # type: ignore[attr-defined]
    losses = [t.train_step(s)["loss"] for s in range(steps)]
    return losses, _state(t), t


def test_regional_compile_trains_like_eager(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    eager, eager_params, _ = _train(tmp_path / "eager", 3, "train.compile=none")
    counters.clear()
    compiled, compiled_params, t = _train(tmp_path / "compiled", 3, "train.compile=regional")
    # 3 layers: 2 norms and the attention core each, a router in the two MoE layers; the final norm and the
    # cross-entropy
    assert len(t.compiled_regions) == 3 * 3 + 2 + 2 and "lm_loss" in t.compiled_regions
    assert "decoder.layers.0.mlp.router.route" not in t.compiled_regions  # layer 0 is dense
    assert "decoder.layers.1.mlp.router.route" in t.compiled_regions
    # One graph per region kind, shared by every layer: norm, attention core, router, loss (up to 2 more where
    # a region splits). A per-layer guard would make 3 of each here, and past dynamo's recompile limit (8
    # layers) it would silently fall back to eager.
    assert 4 <= counters["stats"]["unique_graphs"] <= 6, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    # aot_eager runs the same aten ops as eager: fp32 losses agree to rounding
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=1e-6)
    assert eager[-1] != eager[0]  # the steps trained something
    # grads reached the compiled regions' own weights (norms, QK norms, routers) through the buffers...
    for name in ("decoder.layers.1.input_layernorm.weight", "decoder.layers.2.self_attention.q_layernorm.weight",
                 "decoder.layers.2.mlp.router.weight"):  # fmt: skip
        assert not torch.equal(compiled_params[name], t.initial_state[name]), name
    # ... and every parameter moved as in eager. The compiled backward orders its sums differently (grads
    # differ in the last bits); Adam divides by sqrt(v), which turns that into ~1e-6 on a rarely routed
    # expert's weights after 3 steps at lr 1e-2. A grad that went missing would move a weight ~lr per step.
    for name, value in eager_params.items():
        torch.testing.assert_close(compiled_params[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_compile_choice_and_double_compile(tmp_path):
    assert wants_compile("regional", torch.device("cpu")) and not wants_compile("none", torch.device("cuda"))
    assert wants_compile("auto", torch.device("cuda")) and not wants_compile("auto", torch.device("cpu"))
    _, _, t = _train(tmp_path, 0, "train.compile=none")
    assert t.compiled_regions == []
    compile_regions(t.model, backend="aot_eager")
    with pytest.raises(RuntimeError, match="already applied"):
        compile_regions(t.model, backend="aot_eager")


def test_deterministic_runs_put_inductor_in_its_deterministic_mode(tmp_path, monkeypatch):
    seen = []

    def fake_compile(fn, **kwargs):
        seen.append(kwargs)
        return fn

    monkeypatch.setattr("trainer.compile.torch.compile", fake_compile)
    _, _, t = _train(tmp_path, 0, "train.compile=none")
    compile_regions(t.model, backend="inductor", deterministic=True)
    assert seen and all(k == {"backend": "inductor", "options": {"deterministic": True}} for k in seen)
    seen.clear()
    t.model._moectl_compiled_regions = None
    compile_regions(t.model, backend="aot_eager", deterministic=True)  # options are inductor's only
    assert seen and all(k == {"backend": "aot_eager"} for k in seen)


@pytest.mark.gpu
def test_inductor_regional_compile_trains_like_eager_on_gpu(tmp_path, monkeypatch):
    """Inductor's fused kernels round bf16 differently from eager: losses agree within bf16 tolerance over 8
    steps. Parameters are compared by how far training moved them: a rounding difference can flip a near-tie
    routing, after which an expert's Adam updates (about lr per element and step, whatever the grad's size)
    differ outright, so per-element bounds mean little; over all params together the two runs' movements must
    agree to within a fraction of their size (a region dropping or doubling a grad moves them apart by ~1)."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    gpu = ["train.device=cuda", "mixed_precision.bf16=true", "model.hidden_size=256", "model.seq_length=256",
           "moe.ffn_hidden_size=128", "moe.num_experts=8", "optimizer.lr=1e-3"]  # fmt: skip
    eager, eager_params, te = _train(tmp_path / "eager", 8, *gpu, "train.compile=none")
    compiled, compiled_params, t = _train(tmp_path / "compiled", 8, *gpu, "train.compile=auto")
    assert len(t.compiled_regions) == 13
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-2, atol=1e-2)
    init = te.initial_state  # type: ignore[attr-defined]
    moved = sum(float((eager_params[n].float() - init[n].float()).square().sum()) for n in init) ** 0.5
    apart = sum(float((compiled_params[n].float() - eager_params[n].float()).square().sum()) for n in init) ** 0.5
    print(f"eager moved params by {moved:.4e}; compiled and eager end {apart:.4e} apart ({apart / moved:.3f})")
    assert apart <= 0.25 * moved


def test_inductors_online_softmax_note_is_not_shown(tmp_path):
    """On a GPU every run printed Inductor's "Online softmax is disabled on the fly ..." three times (torch
    2.11 lowering the cross-entropy's softmax as a split reduction): a note to PyTorch's developers. Other
    warnings still show."""
    import warnings

    _, _, t = _train(tmp_path, 0, "train.compile=none")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compile_regions(t.model, backend="aot_eager")
        warnings.warn("\nOnline softmax is disabled on the fly since Inductor decides to\nsplit the reduction.",
                      UserWarning)  # fmt: skip
        warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in seen] == ["something else"]


def test_a_backend_torch_does_not_know_is_the_users_error_naming_the_variable(monkeypatch):
    """It was torch's InvalidBackend from inside the first torch.compile: a traceback, exit 1."""
    from moectl.core.errors import UsageError
    from trainer.compile import compile_backend

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert compile_backend() == "inductor"
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    assert compile_backend() == "aot_eager"
    monkeypatch.setenv(BACKEND_ENV, "inductr")
    with pytest.raises(UsageError, match="MOECTL_COMPILE_BACKEND='inductr' is not a torch.compile backend") as e:
        compile_backend()
    assert e.value.exit_code == 2 and "did you mean inductor?" in (e.value.fix or "")
