"""A bucket group: buckets that reduce their grads and gather their params together.

Invariants:
- all buckets of a group share one process group, one owning optimizer (tag) and one storage
  strategy. A group mixing optimizers is refused at construction: with two optimizers sharing buffers,
  each gathers exactly the groups it owns, so a bucket can never be gathered twice (Megatron's mixed
  Muon/Adam groups were, #6754);
- grad sync: `accumulating -> launched -> reduced`, reset to `accumulating` by zeroing the buffer; a
  grad arriving after the reduce was launched is an error (a non-last micro-batch run without
  `no_sync()` would otherwise add into a buffer being reduced);
- param sync follows `param_sync.ParamSyncMachine`; the hook path and a forced (synchronous) sync both
  end in the same `post_process`, so eval, checkpoint and exit see exactly what training sees (#4562);
- a synchronous sync of many groups may send their all-gathers as one coalesced collective
  (`dispatch_coalesced`); each group still goes `staged -> dispatched -> gathered -> post_processed`, with
  a handle shared by the groups of its process group, so the state never claims data that has not arrived.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Sequence

import torch

from trainer.parallel import comm
from trainer.distributed.bucket import Bucket
from trainer.distributed.param_sync import Action, ParamSyncError, ParamSyncMachine, ParamSyncState


class GradSyncState(Enum):
    ACCUMULATING = "accumulating"
    LAUNCHED = "launched"
    REDUCED = "reduced"


class GradSyncError(RuntimeError):
    """Grad reduction driven out of order (a bug in the training loop or a layer's hooks)."""


Stager = Callable[["BucketGroup"], None]


class BucketGroup:
    def __init__(self, index: int, buckets: Sequence[Bucket], use_distributed_optimizer: bool,
                 grad_scale: float) -> None:
        if not buckets:
            raise ValueError("a bucket group needs at least one bucket")
        keys = {b.buffer.key for b in buckets}
        tags = {k.optimizer_tag for k in keys}
        if len(tags) != 1:
            raise ValueError(
                f"bucket group {index} mixes optimizers {sorted(tags)}: each optimizer must gather only the "
                "buckets it owns (a mixed group is gathered twice or ships stale values, Megatron #6754)"
            )
        if len({b.group.ranks for b in buckets}) != 1 or len({k.is_expert for k in keys}) != 1:
            raise ValueError(f"bucket group {index} mixes process groups (dense and expert buckets)")
        if len({k.storage for k in keys}) != 1:
            raise ValueError(f"bucket group {index} mixes storage strategies")
        self.index = index
        self.buckets = tuple(buckets)
        self.group = buckets[0].group
        self.storage = buckets[0].buffer.storage
        self.tag = tags.pop()
        self.is_expert = buckets[0].buffer.key.is_expert
        self.params = frozenset(p for b in buckets for p in b.params)
        self.use_distributed_optimizer = use_distributed_optimizer
        self.grad_scale = grad_scale
        self.name = f"bucket group {index} ({buckets[0].buffer.key.describe()})"

        self.grad_state = GradSyncState.ACCUMULATING
        self._ready: set[torch.nn.Parameter] = set()
        self._grad_handles: list[Any] = []
        #: zero the grads no layer wrote this step where zero_grad left them stale (trainer/main_grad.py)
        self._stale_guards = [b.buffer.stale_guard(b.params) for b in self.buckets]

        self.sync = ParamSyncMachine(self.name)
        #: writes the owning optimizer's masters into the param buffer (set by the optimizer)
        self.stager: Stager | None = None

    @property
    def aliases_grad(self) -> bool:
        return self.storage.aliases_grad

    @property
    def state(self) -> ParamSyncState:
        return self.sync.state

    @property
    def needs_gather(self) -> bool:
        """Whether the param all-gather moves data (only sharded masters on more than one rank)."""
        return self.use_distributed_optimizer and self.group.size > 1

    # ---------------------------------------------------------------- grad reduction
    def grad_ready(self, param: torch.nn.Parameter) -> None:
        """Count `param`'s grad (last micro-batch, overlap on); launch the reduce when the group is complete."""
        if self.grad_state is not GradSyncState.ACCUMULATING:
            raise GradSyncError(
                f"{self.name}: a grad arrived after its reduce was launched; run every micro-batch but the "
                "last under DistributedModel.no_sync(), and call zero_grad_buffer() before each step's first"
            )
        if param in self._ready:
            raise GradSyncError(f"{self.name}: a param reported its grad twice in one backward")
        self._ready.add(param)
        if len(self._ready) == len(self.params):
            self.start_grad_sync()

    def missing_grads(self) -> list[torch.nn.Parameter]:
        """Params that have not reported this backward (overlap on, last micro-batch)."""
        return [p for b in self.buckets for p in b.params if p not in self._ready]

    def start_grad_sync(self) -> None:
        """Launch the (async) reduce of every bucket: reduce-scatter with sharded masters, else all-reduce."""
        if self.grad_state is not GradSyncState.ACCUMULATING:
            return
        for guard in self._stale_guards:  # every writer of this step ran before (stream order)
            guard.zero_unwritten_()
        for b in self.buckets:
            if self.grad_scale != 1.0:
                b.grad_data.mul_(self.grad_scale)
            if self.use_distributed_optimizer:
                lo, hi = b.shard_range()
                handle = comm.reduce_scatter(b.grad_data[lo:hi], b.grad_data, self.group, async_op=True)
            else:
                handle = comm.all_reduce(b.grad_data, self.group, async_op=True)
            if handle is not None:
                self._grad_handles.append(handle)
        self.grad_state = GradSyncState.LAUNCHED

    def finish_grad_sync(self) -> None:
        """Launch whatever was not launched, then wait: afterwards this rank's shards hold averaged grads."""
        self.start_grad_sync()
        for h in self._grad_handles:
            h.wait()
        self._grad_handles.clear()
        self.grad_state = GradSyncState.REDUCED

    def mark_reduced(self) -> None:
        """Record a reduce that ran where no Python saw it: a CUDA graph replay holding the last micro-batch's
        reductions and their waits (`trainer/graphs/capture.py`). -> `reduced`, as `finish_grad_sync` leaves it."""
        if self._grad_handles:
            raise GradSyncError(f"{self.name}: marked reduced with its own reduce still in flight")
        self.grad_state = GradSyncState.REDUCED

    def reset_grad_sync(self) -> None:
        if self._grad_handles:
            raise GradSyncError(f"{self.name}: zeroing grads while their reduce is in flight")
        self.grad_state = GradSyncState.ACCUMULATING
        self._ready.clear()

    # ---------------------------------------------------------------- param sync
    def stage(self) -> None:
        """Write the owner's new values into the param buffer (this rank's shards) -> `staged`."""
        self.sync.check(Action.STAGE)
        if self.stager is None:
            raise ParamSyncError(f"{self.name}: no optimizer owns this group, nothing can stage it")
        with torch.no_grad():
            self.stager(self)
        self.sync.apply(Action.STAGE)

    def gather_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(output, input) of each bucket's all-gather: the whole bucket, and this rank's shard of it."""
        pairs = []
        for b in self.buckets:
            lo, hi = b.shard_range()
            pairs.append((b.param_data, b.param_data[lo:hi]))
        return pairs

    def dispatch(self) -> None:
        """Start the async all-gather of every bucket -> `dispatched`."""

        def work() -> None:
            for output, input in self.gather_pairs():
                h = comm.all_gather(output, input, self.group, async_op=True)
                if h is not None:
                    self.sync.handles.append(h)

        if self.needs_gather:
            self.sync.run(Action.DISPATCH, work)
        else:
            self.sync.run(Action.DISPATCH)

    def gather(self) -> None:
        """Synchronous all-gather (forced sync, or overlap off) -> `gathered`."""

        def work() -> None:
            for output, input in self.gather_pairs():
                comm.all_gather(output, input, self.group)

        self.sync.run(Action.GATHER, work if self.needs_gather else None)

    def wait(self) -> None:
        def work() -> None:
            for h in self.sync.handles:
                h.wait()
            self.sync.handles.clear()

        self.sync.run(Action.WAIT, work)

    def post_process(self) -> None:
        """The storage's post-gather work for every bucket -> `post_processed`. One code path for all callers."""

        def work() -> None:
            with torch.no_grad():
                for b in self.buckets:
                    self.storage.post_gather(b)

        self.sync.run(Action.POST_PROCESS, work)

    def reset(self) -> None:
        self.sync.run(Action.RESET)

    def mark_gathered(self) -> None:
        """Record a gather that ran where no Python saw it (a CUDA graph replay of a forward whose pre-hooks
        gathered this group at capture): `staged -> post_processed` through the same transitions. Already
        `post_processed`: the capture itself ran the hooks."""
        if self.sync.handles:
            raise ParamSyncError(f"{self.name}: marked gathered with its own gather still in flight")
        if self.state is ParamSyncState.POST_PROCESSED:
            return
        for action in (Action.DISPATCH, Action.WAIT, Action.POST_PROCESS):
            self.sync.apply(action)

    def complete_param_sync(self, force_sync: bool, prefetch: "BucketGroup | None" = None) -> None:
        """Bring this group to `post_processed` (or leave it settled): the one path hooks and forced syncs share.

        staged -> dispatch (hook) or synchronous gather (forced); dispatched -> optionally dispatch
        `prefetch` so its gather overlaps this group's compute, then wait; gathered -> post-process.
        """
        if self.state is ParamSyncState.STAGED:
            if force_sync:
                self.gather()
            else:
                self.dispatch()
        if self.state is ParamSyncState.DISPATCHED:
            if prefetch is not None and not force_sync and prefetch.state is ParamSyncState.STAGED:
                prefetch.dispatch()
            self.wait()
        if self.state is ParamSyncState.GATHERED:
            self.post_process()


def dispatch_coalesced(groups: Sequence[BucketGroup]) -> None:
    """Dispatch the all-gathers of every (staged) group in `groups` as ONE collective per process group.

    The synchronous path's gather (overlap off, eval, checkpoint, any forced sync): nothing overlaps it, so
    instead of one blocking call per bucket, every bucket of every group sharing a process group goes out
    in one coalesced collective (`comm.all_gather_coalesced`), one per process group in order of first
    appearance in `groups` (the same on every rank, so ranks issue matching collectives). Each group ends
    `dispatched`, holding a handle shared with the others of its process group; the caller waits and
    post-processes them in its own order (`complete_param_sync`), so post-processing is exactly the
    per-group path's. Every group is checked before any collective starts: an illegal dispatch (a group
    not `staged`) raises with nothing in flight. The bytes each bucket receives are those of its own
    all-gather, so the result is bitwise the per-bucket path's.
    """
    for g in groups:
        g.sync.check(Action.DISPATCH)
    by_pg: dict[int, list[BucketGroup]] = {}
    for g in groups:
        by_pg.setdefault(id(g.group.pg), []).append(g)  # a ProcessGroup object, not just its ranks: the
        # dense dp group and the expert-dp group can hold the same ranks and still be two communicators
    for members in by_pg.values():
        moving = [g for g in members if g.needs_gather]
        pairs = [pair for g in moving for pair in g.gather_pairs()]
        handle = comm.all_gather_coalesced(pairs, members[0].group) if pairs else None
        shared = comm.CompositeHandle([handle]) if handle is not None else None
        for g in members:
            if shared is not None and g.needs_gather:
                g.sync.handles.append(shared)
            g.sync.apply(Action.DISPATCH)
