"""Delayed fp8 scaling's amax windows travel with a checkpoint (trainer/checkpointing/scaling_state.py).

Without them a resumed run started from empty windows (scale 1 for every operand) and left the
uninterrupted run's path at its first step: N steps straight must equal K steps + save + a fresh Trainer +
N-K steps bit for bit, with the windows (history and scale of every operand, and with fp8 param gather the
storage's weight windows) equal at the end. On CPU the fp8 recipes run by exact emulation.

Two gloo ranks with expert parallelism (ep=2, dp=2 for the dense layers): every rank gets back its own
experts' windows exactly (gathered into global expert order on save, sliced on load), and the dense layers'
per-rank windows come back as their element-wise max (history) and min (scale) over the ranks, on both. The
grouped backend keeps one window per expert in one entry; the per-expert loop one entry per expert,
renumbered to global indices.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import torch
from dist_helpers import run_distributed

from ckpt import open_checkpoint
from moectl.core.config.load import load_config
from trainer.checkpointing.scaling_state import META_KEY, _encode, _fit, local_entries, restore_scaling
from trainer.loop import Trainer
from trainer.observer import SilentObserver
from trainer.validation import validate_checkpoint

FAST = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=16", "model.ffn_hidden_size=32", "model.moe_layer_freq=[1,0]", "moe.num_experts=4",
    "moe.ffn_hidden_size=32", "train.micro_batch_size=2", "train.global_batch_size=4", "data.source=synthetic",
    "train.eval_interval=null", "optimizer.lr_warmup_iters=0", "mixed_precision.bf16=true",
    "mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=delayed", "logging.jsonl=false", "train.device=cpu",
]
GATHER = ["mixed_precision.fp8_param_gather=true"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def trainer(run_dir: Path, *extra: str) -> Trainer:
    return Trainer(load_config(None, [*FAST, f"run_dir={run_dir}", *extra]), SilentObserver())


def windows(t: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    return local_entries(t.model)


@pytest.mark.parametrize("variant", ["grouped", "loop", "param_gather"])
def test_a_resumed_delayed_scaling_run_equals_the_uninterrupted_one(tmp_path: Path, variant: str) -> None:
    extra = {"grouped": ["moe.backend=grouped"], "loop": ["moe.backend=loop"],
             "param_gather": ["moe.backend=grouped", *GATHER]}[variant]  # fmt: skip
    straight = trainer(tmp_path, *extra, "train.train_iters=4", "checkpoint.save_interval=2")
    full = straight.run().losses
    ck = open_checkpoint(tmp_path / "checkpoints" / "step_00000002")
    saved = ck.meta[META_KEY]
    assert any(n.endswith(".input") for n in saved) and any(n.endswith(".grad") for n in saved)
    if variant == "loop":  # the per-expert loop keeps one window per expert: fc1.<e>
        assert "decoder.layers.0.mlp.experts.fc1.3.input" in saved
    if variant == "param_gather":  # the storage's weight windows, with the scales the masters were staged with
        assert "used" in saved["decoder.layers.0.mlp.experts.linear_fc1.gathered"]
    resumed = trainer(tmp_path, *extra, "train.train_iters=4",
                      "checkpoint.load=" + str(tmp_path / "checkpoints" / "step_00000002"))  # fmt: skip
    again = resumed.run().losses
    assert again == full[2:]  # exact floats
    want, got = windows(straight), windows(resumed)
    assert want.keys() == got.keys() and want
    for name in want:
        for field in want[name]:
            assert torch.equal(got[name][field], want[name][field]), (name, field)
    if variant == "param_gather":
        report = validate_checkpoint(ck.path)
        assert report.ok, report.failures()


@pytest.mark.parametrize("gather", [False, True])
def test_the_windows_survive_a_layout_conversion(tmp_path: Path, gather: bool) -> None:
    """`ckpt convert` to per-expert weights carries the windows (the meta), and a per-expert run resumed from it
    continues the single-grouped run bit for bit: the experts' windows are per module, not per layout."""
    from ckpt.convert import convert_checkpoint

    extra = ["moe.backend=grouped", *(GATHER if gather else [])]
    full = trainer(tmp_path / "a", *extra, "train.train_iters=4", "checkpoint.save_interval=2").run().losses
    convert_checkpoint(tmp_path / "a" / "checkpoints" / "step_00000002", tmp_path / "conv", layout="per-expert")
    resumed = trainer(tmp_path / "b", *extra, "moe.single_grouped_weight=false", "train.train_iters=4",
                      f"checkpoint.load={tmp_path / 'conv'}").run().losses  # fmt: skip
    assert resumed == full[2:]


def test_restore_sets_the_saved_windows_and_skips_what_does_not_fit(tmp_path: Path) -> None:
    t = trainer(tmp_path, "moe.backend=grouped", "train.train_iters=2", "checkpoint.save_interval=2")
    t.run()
    meta = open_checkpoint(tmp_path / "checkpoints").meta
    fresh = trainer(tmp_path / "fresh", "moe.backend=grouped", "train.train_iters=2")
    assert not windows(fresh)  # no window is made before the first use
    assert restore_scaling(fresh.model, meta, None) == len(meta[META_KEY]) > 0
    for name, entry in windows(t).items():
        assert torch.equal(windows(fresh)[name]["history"], entry["history"]), name
    # a checkpoint without windows (another recipe, an older moectl) leaves the fresh ones
    other = trainer(tmp_path / "other", "moe.backend=grouped", "train.train_iters=2")
    assert restore_scaling(other.model, {}, None) == 0 and not windows(other)
    # an entry of another shape (another expert count, say) is skipped, the rest restored
    name = next(n for n in meta[META_KEY] if ".experts." in n)
    bad = dict(meta[META_KEY])
    bad[name] = {f: _encode(torch.ones([1] * len(v["shape"]))) for f, v in bad[name].items()}
    assert restore_scaling(other.model, {META_KEY: bad}, None) == len(bad) - 1


def _saved_windows(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's windows, decoded here (base64 fp32 bytes and a shape, docs/checkpoint.md)."""
    def decode(v: dict) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(v["data"])), dtype=torch.float32).reshape(v["shape"])

    return {n: {f: decode(v) for f, v in e.items()} for n, e in open_checkpoint(path).meta[META_KEY].items()}


@pytest.mark.parametrize("load", [["checkpoint.no_load_optim=true"],
                                  ["checkpoint.no_load_optim=true", "checkpoint.load_main_params_from_ckpt=true"]])
def test_the_windows_come_back_without_the_optimizer_state(tmp_path: Path, load: list[str]) -> None:
    """They are the model's quantizers' state, not the optimizer's (TE loads its fp8 meta with the module)."""
    trainer(tmp_path, "moe.backend=grouped", "train.train_iters=2", "checkpoint.save_interval=2").run()
    saved = _saved_windows(tmp_path / "checkpoints")
    t = trainer(tmp_path / "r", "moe.backend=grouped", "train.train_iters=4", *load,
                f"checkpoint.load={tmp_path / 'checkpoints'}")  # fmt: skip
    got = windows(t)
    assert got.keys() == saved.keys()
    for name in saved:
        assert torch.equal(got[name]["history"], saved[name]["history"]), name


@pytest.mark.parametrize("saved_backend, resumed_backend", [("loop", "grouped"), ("grouped", "loop")])
def test_a_resume_on_the_other_expert_backend_keeps_the_windows(tmp_path: Path, saved_backend: str,
                                                               resumed_backend: str) -> None:  # fmt: skip
    """The per-expert loop keeps a window per expert (`fc1.<e>`), the grouped backends one per fc with an expert
    axis: a resume on the other backend gets the same windows in its own form, and makes no state of the
    other form (a later save would carry stale windows)."""
    trainer(tmp_path, f"moe.backend={saved_backend}", "train.train_iters=2", "checkpoint.save_interval=2").run()
    saved = _saved_windows(tmp_path / "checkpoints")
    t = trainer(tmp_path / "r", f"moe.backend={resumed_backend}", "train.train_iters=4",
                f"checkpoint.load={tmp_path / 'checkpoints'}")  # fmt: skip
    experts = t.model.decoder.layers[0].mlp.experts
    got = windows(t)
    for fc in ("fc1", "fc2"):
        for role in ("input", "weight", "grad"):
            whole = f"decoder.layers.0.mlp.experts.{fc}.{role}"
            per = [f"decoder.layers.0.mlp.experts.{fc}.{e}.{role}" for e in range(4)]
            if resumed_backend == "grouped":
                assert torch.equal(got[whole]["history"], torch.stack([saved[n]["history"] for n in per], dim=-1))
            else:
                for e, n in enumerate(per):
                    assert torch.equal(got[n]["history"], saved[whole]["history"][..., e]), n
    want_keys = {"fc1", "fc2"} if resumed_backend == "grouped" else {f"fc{i}.{e}" for i in (1, 2) for e in range(4)}
    assert set(experts.recipe_states) == want_keys


def test_a_resume_in_another_fp8_format_recomputes_the_scales(tmp_path: Path) -> None:
    """A `hybrid` checkpoint (e5m2 grads, largest value 57344) resumed as `e4m3` (448): the grads' scales come
    from the saved amaxes and this run's format, not the saved e5m2 scales (128x too large for e4m3)."""
    trainer(tmp_path, "moe.backend=grouped", "mixed_precision.fp8=hybrid", "train.train_iters=2",
            "checkpoint.save_interval=2").run()  # fmt: skip
    saved = _saved_windows(tmp_path / "checkpoints")
    t = trainer(tmp_path / "r", "moe.backend=grouped", "train.train_iters=4",
                f"checkpoint.load={tmp_path / 'checkpoints'}")  # fmt: skip
    got = windows(t)
    grads = [n for n in saved if n.endswith(".grad")]
    assert grads
    for n in grads:
        window = saved[n]["history"].amax(dim=0)
        assert (window > 0).all(), n
        assert torch.allclose(got[n]["scale"], 448.0 / window), n
        assert torch.allclose(saved[n]["scale"], 57344.0 / window), n
    for n in saved:  # e4m3 operands: the saved scales, bit for bit
        if not n.endswith(".grad"):
            assert torch.equal(got[n]["scale"], saved[n]["scale"]), n


def test_a_run_without_delayed_scaling_saves_no_windows(tmp_path: Path) -> None:
    t = trainer(tmp_path, "moe.backend=grouped", "mixed_precision.fp8_recipe=tensorwise", "train.train_iters=1",
                "checkpoint.save_interval=1")  # fmt: skip
    t.run()
    assert META_KEY not in open_checkpoint(tmp_path / "checkpoints").meta


def test_a_window_of_another_length_keeps_the_newest_entries() -> None:
    saved = torch.arange(6.0).reshape(3, 2)  # newest first
    assert torch.equal(_fit(saved, 2), saved[:2])
    assert torch.equal(_fit(saved, 5), torch.cat((saved, torch.zeros(2, 2))))


EP = ["parallel.expert_model_parallel_size=2", "train.train_iters=3"]


def _as_bytes(t: Trainer) -> dict[str, tuple[list[int], bytes]]:
    return {f"{n}/{f}": (list(v.shape), v.numpy().tobytes()) for n, e in local_entries(t.model).items()
            for f, v in e.items()}  # fmt: skip


def _save_then_load(rank: int, world: int, root: str, backend: str) -> tuple[dict, dict, list[float]]:
    extra = [*EP, f"moe.backend={backend}", f"run_dir={root}"]
    t = Trainer(load_config(None, [*FAST, *extra]), SilentObserver())
    for step in range(2):
        t.train_step(step)
    t.save(2)
    before = _as_bytes(t)
    u = Trainer(load_config(None, [*FAST, *extra, f"checkpoint.load={root}/checkpoints"]), SilentObserver())
    after = _as_bytes(u)
    losses = u.run().losses  # and the run goes on from them
    return before, after, losses


def _tensor(shape_bytes: tuple[list[int], bytes]) -> torch.Tensor:
    shape, raw = shape_bytes
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["grouped", "loop"])
def test_expert_parallel_windows_come_back_to_their_ranks(tmp_path, backend: str) -> None:
    results = run_distributed(_save_then_load, root=str(tmp_path), backend=backend)
    (before0, after0, losses0), (before1, after1, losses1) = results
    assert len(losses0) == len(losses1) == 1 and all(torch.isfinite(torch.tensor(losses0 + losses1)))
    for before, after in ((before0, after0), (before1, after1)):
        assert before.keys() == after.keys() and before
    experts = [k for k in before0 if ".experts." in k]
    dense = [k for k in before0 if ".experts." not in k]
    assert experts and dense
    for k in experts:  # each rank's own experts (loop: local names; grouped: local columns), exactly
        assert after0[k] == before0[k] and after1[k] == before1[k], k
    assert any(before0[k] != before1[k] for k in experts)  # the ranks hold different experts' windows
    for k in dense:
        a, b = _tensor(before0[k]), _tensor(before1[k])
        want = torch.maximum(a, b) if k.endswith("/history") else torch.minimum(a, b)
        assert torch.equal(_tensor(after0[k]), want) and torch.equal(_tensor(after1[k]), want), k
    assert any(before0[k] != before1[k] for k in dense if k.endswith("/history"))  # the ranks saw other tokens
