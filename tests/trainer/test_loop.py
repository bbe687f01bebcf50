import json
import math

import pytest
import torch
from trainer.observer import SilentObserver

from moectl.core.config.load import load_config
from trainer.loop import NonFiniteError, Trainer
from trainer.optim.step_result import NonFiniteGradError

FAST = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=32", "model.vocab_size=256", "moe.num_experts=4", "moe.ffn_hidden_size=16",
    "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_iters=2", "data.source=synthetic",
    "optimizer.lr_warmup_iters=0",
]


def make(tmp_path, *extra: str) -> Trainer:
    cfg = load_config(None, [*FAST, f"run_dir={tmp_path / 'run'}", *extra])
    return Trainer(cfg, SilentObserver())


def test_metrics_jsonl_fields_and_full_precision_losses(tmp_path):
    result = make(tmp_path, "train.train_iters=4", "train.eval_interval=2").run()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    evals = [r for r in lines if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_s"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0
    assert [r["step"] for r in evals] == [2, 4]
    # repr round trip: the file holds exactly the losses the run computed.
    assert [r["loss"] for r in train] == result.losses
    assert (tmp_path / "run" / "config.yaml").is_file()


def test_metrics_jsonl_keeps_the_last_step_whatever_the_log_interval(tmp_path):
    make(tmp_path, "train.train_iters=5", "train.log_interval=2", "train.eval_interval=null").run()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [2, 4, 5]


def test_loss_falls_on_real_text(tmp_path):
    # Byte-level Python source: unigram/bigram structure is learnt within a few dozen steps.
    result = make(tmp_path, "train.train_iters=25", "train.eval_interval=null", "optimizer.lr=1e-2",
                  "data.source=corpus").run()
    assert result.losses[-1] < 0.75 * result.losses[0]


def test_deterministic_runs_are_bit_identical(tmp_path):
    a = make(tmp_path / "a", "train.train_iters=3", "train.deterministic=true").run()
    b = make(tmp_path / "b", "train.train_iters=3", "train.deterministic=true").run()
    assert a.losses == b.losses
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_expert_layouts_train_to_the_same_losses(tmp_path, backend):
    runs = [
        make(tmp_path / str(single), "train.train_iters=4", f"moe.single_grouped_weight={single}",
             f"moe.backend={backend}").run().losses
        for single in (True, False)
    ]
    assert runs[0] == runs[1]


def _poison(trainer: Trainer, at_step: int, grads: bool = True, loss: bool = True) -> list[int]:
    """Make the loss NaN on the micro-batches of optimizer step `at_step` (1-based); `grads=False`: only the
    reported loss, the one backpropagated stays finite (so are the grads); `loss=False`: only the one
    backpropagated (the grads), the reported loss stays finite."""
    calls = []
    real = trainer.model.loss

    def poisoned(tokens, targets):
        parts = real(tokens, targets)
        calls.append(1)
        if len(calls) > (at_step - 1) * trainer.n_micro and len(calls) <= at_step * trainer.n_micro:
            if grads:
                parts.total = parts.total * float("nan")
            if loss:
                parts.lm_loss = parts.lm_loss * float("nan")
        return parts

    trainer.model.loss = poisoned  # type: ignore[method-assign]
    return calls


def test_nonfinite_loss_stops_with_a_clear_message(tmp_path):
    t = make(tmp_path, "train.train_iters=5", "train.on_nonfinite=stop")
    _poison(t, at_step=3)
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 3.*no update was applied") as e:
        t.run()
    assert "train.on_nonfinite=skip" in e.value.fix


def test_nonfinite_step_is_skipped_without_touching_params(tmp_path):
    t = make(tmp_path, "train.train_iters=3", "train.on_nonfinite=skip", "train.eval_interval=null")
    _poison(t, at_step=3)
    t.train_step(0)
    t.train_step(1)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    record = t.train_step(2)
    assert record["skipped"] and math.isnan(record["loss"])
    for n, p in t.model.named_parameters():
        assert torch.equal(p, before[n]), n


@pytest.mark.parametrize("optimizer", ["adam", "muon", "sgd"])
@pytest.mark.parametrize("on_nonfinite", ["skip", "stop"])
def test_a_nonfinite_loss_skips_the_update_even_with_finite_grads(tmp_path, on_nonfinite, optimizer):
    """The loss reaches the optimizer as a device tensor (the host queues the update before it reads the loss):
    a non-finite one must still leave every param as it was, also where the grads are finite, and a stopping
    run names the loss."""
    t = make(tmp_path, "train.train_iters=3", f"train.on_nonfinite={on_nonfinite}", "train.eval_interval=null",
             f"optimizer.optimizer={optimizer}")
    _poison(t, at_step=2, grads=False)
    t.train_step(0)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    if on_nonfinite == "stop":
        with pytest.raises(NonFiniteError, match=r"non-finite loss at step 2"):
            t.train_step(1)
    else:
        record = t.train_step(1)
        assert record["skipped"] and math.isnan(record["loss"]) and math.isfinite(record["grad_norm"])
    for n, p in t.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert t.engine.step_count == 1


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_nonfinite_grads_with_a_finite_loss_stop_the_run(tmp_path, optimizer):
    """`on_nonfinite: stop` stops on a non-finite grad norm too, on either engine (SGD runs on the one-device
    `LocalEngine`, which used to skip such a step and go on), before any update."""
    t = make(tmp_path, "train.train_iters=3", "train.on_nonfinite=stop", "train.eval_interval=null",
             f"optimizer.optimizer={optimizer}", "train.device=cpu")
    _poison(t, at_step=2, loss=False)
    t.train_step(0)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    with pytest.raises(NonFiniteGradError, match="non-finite gradient"):
        t.train_step(1)
    for n, p in t.model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_banner_warns_when_the_run_reads_its_data_over_and_over(tmp_path):
    """A split too small for the run is read many times over; the banner says so (it said nothing)."""
    tokens = tmp_path / "small.bin"
    tokens.write_bytes(bytes(b for i in range(80) for b in (i, 0)))  # 80 uint16 tokens: 47 train, 33 held out
    banner = make(tmp_path, "data.source=tokens", f"data.path={tokens}", "train.train_iters=3")._banner()
    assert any(line.startswith("  warning: data: 3 steps of 4 x 32 tokens read the 47-token train split")
               for line in banner), banner
    assert not any("warning: data:" in line for line in make(tmp_path, "train.train_iters=3")._banner())


def test_cuda_graphs_off_the_gpu_are_refused_not_ignored(tmp_path):
    """train.cuda_graph on the CPU (rule MOE035): a run started without the CLI's rule check refuses it
    itself rather than running eagerly while the config says graphs."""
    from moectl.core.errors import ConfigError

    # pinned to the CPU: on a GPU host the default device would be CUDA, where graphs are allowed
    assert not any("cuda_graph:" in line for line in make(tmp_path, "train.device=cpu")._banner())
    with pytest.raises(ConfigError, match="train.cuda_graph"):
        make(tmp_path, "train.device=cpu", "train.cuda_graph=true", "moe.capacity_factor=1.25",
             "moe.pad_expert_input_to_capacity=true")


def test_router_padding_without_a_recipe_is_refused_not_ignored(tmp_path):
    """`router_padding_for_quantization` is what the dispatcher does under a recipe (pad each expert to its
    alignment); without one it would be accepted and ignored, so the build refuses it (as rule MOE007)."""
    from moectl.core.errors import ConfigError

    with pytest.raises(ConfigError, match="moe.router_padding_for_quantization"):
        make(tmp_path, "moe.router_padding_for_quantization=true")
    t = make(tmp_path, "moe.router_padding_for_quantization=true", "mixed_precision.bf16=true",
             "mixed_precision.fp8=e4m3", "moe.backend=grouped")  # fmt: skip
    assert t.model.moe_layers()[0].dispatcher.align == t.model.recipe.align_size == 16


@pytest.mark.parametrize("extra", ["mixed_precision.bf16=true", "parallel.gradient_accumulation_fusion=true"])
def test_sgd_refuses_what_its_engine_cannot_run_before_training(tmp_path, extra):
    """SGD's one-device engine has no fp32 masters and no main_grad buffers: a Trainer built directly (no CLI
    rule check) refuses with one config error, not a traceback at the first backward (fused weight grads)."""
    from moectl.core.errors import ConfigError

    with pytest.raises(ConfigError, match="MOE070"):
        make(tmp_path, "optimizer.optimizer=sgd", extra)
