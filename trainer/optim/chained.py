"""`ChainedOptimizer`: several optimizers over disjoint tags of one `DistributedModel`, stepped as one.

Megatron's `ChainedOptimizer([LayerWise(Muon), DistOpt(Adam)])` (#4771). Per `step(lr)`:

1. every member's groups must be reduced and stageable (checked for all before any master moves);
2. one joint grad norm: the members' counted sums of squares (`local_grad_sq`, float64) are added and
   all-reduced once over the world together with a found-inf flag, so clipping uses the norm of all
   grads (every element once across dp and ep ranks) and every rank gets the same verdict (a
   `GradVerdict` on the device: a member whose update takes it as tensors queues its update before any
   host read);
3. every member steps with that (norm, found_inf): all skip together (`on_nonfinite: skip`), or the
   first raises `NonFiniteGradError` on every rank (`stop`), before any update or after one queued with the
   verdict on the device that the flag leaves writing nothing; otherwise each updates
   its masters with the same clip factor, stages and gathers only its own bucket groups.

The logical state interface (`gather_logical_state`, `load_logical_state`, `step_count`) is the members'
merged, so checkpoints and `ckpt validate` see one optimizer. `state_keys(name)` says which entries a
param has (AdamW: master, exp_avg, exp_avg_sq; Muon: master, momentum_buffer).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, Sequence

import torch

from moectl.core.config.schema import OptimizerConfig
from trainer.distributed.bucket_group import GradSyncError
from trainer.distributed.ddp import DistributedModel
from trainer.distributed.param_sync import Action
from trainer.optim.distributed_optimizer import DistributedOptimizer
from trainer.optim.grad_norm import GradVerdict, global_grad_verdict
from trainer.optim.layerwise import LayerWiseMuon
from trainer.optim.muon_routing import ADAM_TAG, MUON_TAG
from trainer.optim.step_result import StepResult


class Member(Protocol):
    """What the chain needs of an optimizer over one tag (DistributedOptimizer and LayerWiseMuon have it)."""

    tag: str
    step_count: int
    skipped_steps: int
    buffers: list[Any]

    def local_grad_sq(self) -> torch.Tensor: ...

    def step(self, lr: float, *, joint_norm: GradVerdict | None = None) -> StepResult: ...

    def gather_logical_state(self) -> dict[str, Any]: ...

    def load_logical_state(self, state: dict[str, Any], strict: bool = True) -> None: ...

    def state_keys(self, name: str) -> tuple[str, ...]: ...


def _names(member: Member) -> set[str]:
    return {buf.names[p] for buf in member.buffers for p in buf.params}


class ChainedOptimizer:
    def __init__(self, dmodel: DistributedModel, members: Sequence[Member]) -> None:
        if not members:
            raise ValueError("a chain needs at least one optimizer")
        self.dmodel = dmodel
        self.members = list(members)
        self._owner: dict[str, Member] = {}
        for m in self.members:
            for name in _names(m):
                if name in self._owner:
                    raise ValueError(f"{name} is stepped by two optimizers ({self._owner[name].tag}, {m.tag})")
                self._owner[name] = m
        unowned = sorted(set(dmodel.params_by_name) - self._owner.keys())
        if unowned:
            raise ValueError(f"no optimizer of the chain steps {unowned}")

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (members step and skip together, so theirs are equal)."""
        return self.members[0].step_count

    @property
    def skipped_steps(self) -> int:
        return self.members[0].skipped_steps

    def owners(self) -> dict[str, list[str]]:
        """Param names per optimizer tag."""
        return {m.tag: sorted(_names(m)) for m in self.members}

    def state_keys(self, name: str) -> tuple[str, ...]:
        """The logical state entries of `name`: those of the member that owns it."""
        return self._owner[name].state_keys(name)

    def local_grad_sq(self) -> torch.Tensor:
        return sum((m.local_grad_sq() for m in self.members[1:]), self.members[0].local_grad_sq())

    def _check_ready(self) -> None:
        if not self.dmodel.grads_reduced(None):
            raise GradSyncError("optimizer.step() before DistributedModel.finish_grad_sync(): grads are not reduced")
        for g in self.dmodel.groups_for(None):
            g.sync.check(Action.STAGE)

    @torch.no_grad()
    def step(self, lr: float, *, loss: torch.Tensor | None = None) -> StepResult:
        """One joint norm and verdict (a non-finite `loss` skips too), then every member steps (see the module
        docstring)."""
        self._check_ready()
        joint = global_grad_verdict(self.local_grad_sq(), self.dmodel.pstate.dp, loss)
        results = [m.step(lr, joint_norm=joint) for m in self.members]
        return StepResult(joint.read()[0], skipped=any(r.skipped for r in results))

    @torch.no_grad()
    def gather_logical_state(self) -> dict[str, Any]:
        """The members' `{"step", "params"}` merged (collective, as each member's is)."""
        out: dict[str, Any] = {"step": self.step_count, "params": {}}
        for m in self.members:
            out["params"].update(m.gather_logical_state()["params"])
        return out

    @torch.no_grad()
    def load_logical_state(self, state: dict[str, Any], strict: bool = True) -> None:
        """Hand each member the entries of its params (and the step)."""
        params = state.get("params", {})
        for m in self.members:
            sub: dict[str, Any] = {"params": {n: params[n] for n in _names(m) if n in params}}
            if "step" in state:
                sub["step"] = state["step"]
            m.load_logical_state(sub, strict=strict)


def build_muon_optimizer(dmodel: DistributedModel, cfg: OptimizerConfig,
                         on_nonfinite: Literal["stop", "skip"] = "stop") -> ChainedOptimizer:
    """Muon (layer-wise) for the "muon" tag chained with AdamW (`DistributedOptimizer`) for the "adam" tag.

    A tag without params is left out (a model whose every param is a matrix, or none is).
    """
    tags = {b.key.optimizer_tag for b in dmodel.buffers}
    members: list[Member] = []
    if MUON_TAG in tags:
        members.append(LayerWiseMuon(dmodel, cfg, tag=MUON_TAG, on_nonfinite=on_nonfinite))
    if ADAM_TAG in tags:
        members.append(DistributedOptimizer(dmodel, cfg, tag=ADAM_TAG, on_nonfinite=on_nonfinite))
    return ChainedOptimizer(dmodel, members)
