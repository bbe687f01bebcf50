"""Two gloo ranks: parallel writes round-trip, retention is rank 0's alone (test 15), and one rank's failure
fails the save on every rank with no commit and no hang (acceptance test 4; PyTorch DCP's FaultyStorageWriter)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ckpt_fixtures import make_meta
from dist_helpers import run_distributed

from ckpt import CheckpointSaveError, list_committed, open_checkpoint, save_checkpoint


def _value(rank: int, step: int) -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).view(6, 4) * (rank + 1) + step


def _files(rank: int, step: int) -> dict[str, dict[str, torch.Tensor]]:
    """Each rank writes its own model and optim file (the ownership a dp=2 distributed optimizer has)."""
    return {
        f"model-{rank:05d}.safetensors": {f"layer{rank}.weight": _value(rank, step).to(torch.bfloat16)},
        f"optim-{rank:05d}.safetensors": {
            f"layer{rank}.weight.main_param": _value(rank, step),
            f"layer{rank}.weight.exp_avg": -_value(rank, step),
        },
    }


def _meta(rank: int) -> dict[str, Any]:
    # Only rank 0's meta goes into the manifest; rank 1 passes none, as the docstring allows.
    owners = {f"layer{r}.weight": r for r in range(2)}
    return make_meta(world={"dp": 2, "ep": 1, "owners": owners}) if rank == 0 else {}


def _save_steps_5_to_30(rank: int, world_size: int, root: str) -> dict[str, Any]:
    deletes: list[str] = []
    if rank != 0:  # record (and refuse) any delete rank 1 attempts
        import ckpt.retention

        real_rmtree = shutil.rmtree

        def spy_rmtree(path: Any, *a: Any, **k: Any) -> None:
            deletes.append(f"rmtree {path}")
            real_rmtree(path, *a, **k)

        def spy_remove(path: Path) -> None:
            deletes.append(f"remove_step_dir {path}")

        shutil.rmtree = spy_rmtree  # type: ignore[assignment]
        ckpt.retention.remove_step_dir = spy_remove  # type: ignore[assignment]
    for step in range(5, 31, 5):
        path = save_checkpoint(root, step, _files(rank, step), _meta(rank), keep_last=2)
        assert path == Path(root) / f"step_{step:08d}"
        # Each rank reads a slice of the tensor the other rank wrote, as a rank of another layout would.
        other = 1 - rank
        with open_checkpoint(root) as ck:
            assert ck.step == step
            got = ck.read(f"layer{other}.weight.main_param", slice(2 * other, 2 * other + 3))
            assert torch.equal(got, _value(other, step)[2 * other : 2 * other + 3])
    return {"rank": rank, "deletes": deletes, "threads": torch.get_num_threads()}


@pytest.mark.slow
def test_two_ranks_write_in_parallel_and_only_rank_0_deletes(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    results = run_distributed(_save_steps_5_to_30, world_size=2, root=str(root))
    assert [r["rank"] for r in results] == [0, 1] and [r["threads"] for r in results] == [1, 1]  # the helper's promises
    assert results[1]["deletes"] == []
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000025", "step_00000030"]
    with open_checkpoint(root) as ck:
        assert ck.manifest["world"]["owners"] == {"layer0.weight": 0, "layer1.weight": 1}
        assert {f: r["rank"] for f, r in ck.manifest["files"].items()} == {
            "model-00000.safetensors": 0, "optim-00000.safetensors": 0,
            "model-00001.safetensors": 1, "optim-00001.safetensors": 1,
        }  # fmt: skip
        for rank in range(2):
            for name, t in _files(rank, 30)[f"optim-{rank:05d}.safetensors"].items():
                assert torch.equal(ck.read(name), t)
            assert torch.equal(ck.read(f"layer{rank}.weight"), _value(rank, 30).to(torch.bfloat16))


def _failing_saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    save_checkpoint(root, 5, _files(rank, 5), _meta(rank))
    for phase in ("write", "finalize"):
        os.environ["MOECTL_CKPT_FAIL"] = f"1:{phase}"
        try:
            save_checkpoint(root, 10, _files(rank, 10), _meta(rank))
            out[phase] = "saved"
        except CheckpointSaveError as e:
            out[phase] = {"ranks": e.ranks, "line": e.one_line(), "committed": e.committed}
        dist.barrier()
        out[f"{phase} left"] = sorted(os.listdir(root))
    del os.environ["MOECTL_CKPT_FAIL"]
    try:  # both ranks claim the same file: caught in the vote, before anything is committed
        save_checkpoint(root, 10, {"model-00000.safetensors": {f"x{rank}": torch.ones(1)}}, _meta(rank))
        out["clash"] = "saved"
    except CheckpointSaveError as e:
        out["clash"] = {"ranks": e.ranks, "line": e.one_line(), "committed": e.committed}
    return out


@pytest.mark.slow
def test_a_failure_on_rank_1_fails_the_save_on_both_ranks(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    results = run_distributed(_failing_saves, world_size=2, root=str(root))
    for rank, out in enumerate(results):
        for phase in ("write", "finalize"):
            err = out[phase]
            assert isinstance(err, dict), f"rank {rank} {phase}: {err}"
            assert err["ranks"] == [1] and not err["committed"]
            assert f"failed on rank 1: InjectedFault: injected fault MOECTL_CKPT_FAIL=1:{phase}" in err["line"]
            assert "nothing was committed and latest is unchanged" in err["line"]
            assert out[f"{phase} left"] == ["latest", "step_00000005"]  # no manifest, no partial folder
        # Whichever rank creates the file second fails (files are opened exclusive, never clobbered).
        assert out["clash"] == results[0]["clash"] and len(out["clash"]["ranks"]) == 1
        assert "model-00000.safetensors" in out["clash"]["line"] and not out["clash"]["committed"]
    assert (root / "latest").read_text() == "step_00000005\n"
    assert list_committed(root) == [root / "step_00000005"]
