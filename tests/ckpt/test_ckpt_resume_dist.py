"""2 gloo ranks: 20 steps straight == 10 + save + fresh processes + 10, and dp 2 -> 1 -> 2 resharding keeps masters bit-exact."""

import pytest
import torch
from dist_helpers import run_distributed
from trainer.observer import SilentObserver

from ckpt import open_checkpoint
from moectl.core.config.load import load_config
from moectl.core.errors import UsageError
from trainer.loop import Trainer

FAST = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.seq_length=32", "moe.num_experts=4", "moe.ffn_hidden_size=16", "train.micro_batch_size=2",
    "train.global_batch_size=4", "data.source=synthetic", "train.eval_interval=null", "optimizer.lr_warmup_iters=2",
    "optimizer.lr_decay_iters=20", "train.train_iters=20",
]
HALF = 10


def trainer(*extra: str) -> Trainer:
    return Trainer(load_config(None, [*FAST, *extra]), SilentObserver())


def masters(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: e["master"] for n, e in t.engine.optimizer.gather_logical_state()["params"].items()}


def final_state(t: Trainer) -> dict[str, bytes]:
    """Params, masters, moments, optimizer step and last LR as bytes (exact, and safe to return from a child)."""
    state = t.engine.optimizer.gather_logical_state()
    out = {n: p.detach().float().numpy().tobytes() for n, p in t.model.named_parameters()}
    for n, e in state["params"].items():
        out.update({f"{n}.{k}": v.numpy().tobytes() for k, v in e.items()})
    out["step"] = str(state["step"]).encode()
    return out


def _straight_and_first_half(rank: int, world: int, root: str) -> tuple[list[float], dict[str, bytes], float]:
    straight = trainer(f"run_dir={root}/a")
    full = straight.run().losses
    lr = straight.last_record["lr"]
    half = trainer(f"run_dir={root}/b")  # the same 20-step schedule, stopped after step 10
    for step in range(HALF):
        half.train_step(step)
    half.save(HALF)
    return full, final_state(straight), lr


def _second_half(rank: int, world: int, root: str) -> tuple[list[float], dict[str, bytes], float]:
    t = trainer(f"run_dir={root}/b", f"checkpoint.load={root}/b/checkpoints")
    assert t.start_step == HALF
    losses = t.run().losses
    return losses, final_state(t), t.last_record["lr"]


def _load_and_report(rank: int, world: int, root: str, load: str) -> dict[str, bytes]:
    # Bytes, not tensors: tensors cross the process boundary as shared-memory handles that die with the child.
    return {n: t.numpy().tobytes() for n, t in masters(trainer(f"run_dir={root}/r2", f"checkpoint.load={load}")).items()}


@pytest.mark.slow
def test_resume_in_fresh_processes_and_reshard_dp_2_1_2(tmp_path):
    root = str(tmp_path)
    straight = run_distributed(_straight_and_first_half, root=root)
    resumed = run_distributed(_second_half, root=root)
    for rank in (0, 1):
        full, state, lr = straight[rank]
        losses, state_b, lr_b = resumed[rank]
        assert losses == full[HALF:]  # exact floats
        assert lr_b == lr and state_b.keys() == state.keys()
        for k in state:
            assert state_b[k] == state[k], k  # params, masters, moments, step: bit-identical

    # dp=2 checkpoint -> dp=1 (this process) -> save -> dp=2: masters bit-exact all the way.
    saved = open_checkpoint(tmp_path / "b" / "checkpoints")
    want = {n[: -len(".main_param")]: saved.read(n) for n in saved.tensor_names() if n.endswith(".main_param")}
    one = trainer(f"run_dir={root}/r1", f"checkpoint.load={root}/b/checkpoints")
    got = masters(one)
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n
    one.save(HALF)
    back = run_distributed(_load_and_report, root=root, load=f"{root}/r1/checkpoints")
    for n in want:
        assert back[0][n] == back[1][n] == want[n].numpy().tobytes(), n


def _ep2_save_and_resume(rank: int, world: int, root: str, layout: bool) -> tuple[list[float], list[float]]:
    ep = ["parallel.expert_model_parallel_size=2", f"moe.single_grouped_weight={layout}"]
    full = trainer(f"run_dir={root}/ep_a", *ep).run().losses
    half = trainer(f"run_dir={root}/ep_b", *ep)
    for step in range(HALF):
        half.train_step(step)
    half.save(HALF)
    resumed = trainer(f"run_dir={root}/ep_b", *ep, f"checkpoint.load={root}/ep_b/checkpoints").run().losses
    return full, resumed


@pytest.mark.slow
@pytest.mark.parametrize("layout", [True, False])
def test_expert_parallel_checkpoint_resumes_bitwise_and_loads_at_ep1(tmp_path, layout):
    from moectl.core.config.load import overridden
    from trainer.validation import validate_checkpoint

    for full, resumed in run_distributed(_ep2_save_and_resume, root=str(tmp_path), layout=layout):
        assert resumed == full[HALF:]
    ck = open_checkpoint(tmp_path / "ep_b" / "checkpoints")
    # Logical tensors: all 4 experts, whatever the ep size that wrote them.
    if layout:
        assert ck.tensor_info("decoder.layers.0.mlp.experts.linear_fc1.weight.main_param").shape == (4, 32, 32)
    else:
        assert "decoder.layers.0.mlp.experts.linear_fc1.weight3.main_param" in ck.tensor_names()
    # its own config asks for ep=2 on one process: refused as a usage error (the checkpoint is fine; the command
    # names the --set), not silently changed; with ep=1 it validates
    with pytest.raises(UsageError, match="recorded layout does not fit this world") as err:
        validate_checkpoint(ck.path)
    assert "--set parallel.expert_model_parallel_size=N" in (err.value.fix or "")
    report = validate_checkpoint(ck.path, overridden(["parallel.expert_model_parallel_size=1"]))
    assert report.ok, report.failures()
