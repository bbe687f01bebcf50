"""`DistributedModel`: wrap a single-device model for data (and expert) parallel training.

The model code is written for one device; this wrapper (torchtitan's "parallelize" idea) lays its
trainable params out in contiguous buffers, gives each a `main_grad` view, hooks grad readiness, reduces
grads per bucket group, and drives the param all-gather. Optimizers see buffers and bucket groups, not
modules. Invariants:

- every trainable param is in exactly one buffer and one bucket group; its `main_grad` is a view of the
  grad buffer, and (high-precision storage) its `.data` is a view of the param buffer;
- the per-expert params of an expert linear (`weight0..weight{E-1}`, `bias0..`) lie exactly where, and as,
  its grouped `weight` / `bias` would in the other layout: same start, experts 0..E-1 back to back, one
  bucket (`backward_order`, `layout.py`'s runs); so both layouts' grad buffers are equal element for
  element, and so is the grad norm summed over them;
- every param reports its grad exactly once per backward (`trainer.main_grad.grad_ready`): fused layers
  accumulate into `main_grad` and report themselves; plain-autograd grads are folded in by a
  post-accumulate hook, which reports only when autograd actually produced a `.grad` (the hook also
  fires with `.grad is None` for params whose grad a custom Function returned as None);
- grads are scaled by 1/dp before the SUM collective, for dense and expert params alike: an expert
  param's grad on its owner already sums the contributions of the tokens of every ep rank (the
  all-to-all backward), so reducing over expert-dp (dp/ep ranks) and scaling by 1/dp averages over the
  whole global batch (Megatron's `expert_gradient_scaling_factor`). With ep = 1 this is dividing by the
  group size;
- a param never gets a grad while its group's param gather is pending: its forward would have used
  stale weights (checked on every grad). With `overlap_param_gather` the gather completes in the
  forward pre-hook of the first called module that contains the param (not the root), so a model must
  reach every param through some submodule's `__call__` (`F.linear(x, self.head.weight)` in the root's
  forward does not, and is refused on backward);
- with the distributed optimizer, after `finish_grad_sync` only this rank's shard of each bucket holds
  reduced grads (the rest is scratch);
- wrap the model after moving it to its device (`.to()` afterwards would give params new storage and
  silently unbind them from the buffers).

Per step, the training loop does::

    dmodel.zero_grad_buffer()                 # also re-stages pending aliased staging (must follow the zero)
    for i, mb in enumerate(micro_batches):
        ctx = dmodel.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext()
        with ctx:
            loss = dmodel(mb) / len(micro_batches)
            loss.backward()                   # overlap_grad_reduce: buckets launch during the last backward
    dmodel.finish_grad_sync()                 # wait (or run) every reduce
    result = optimizer.step(lr)               # masters, clip, write-back, gather now or in the next forward
    ...
    dmodel.force_param_sync()                 # before eval, checkpoint save, hash checks, exit
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterator, Mapping

import torch

from trainer import grad_sq
from trainer.moe import wgrad_deferral
from trainer.parallel import comm
from trainer.distributed.bucket_group import BucketGroup, GradSyncError, GradSyncState, dispatch_coalesced
from trainer.distributed.buffers import BufferKey, ParamAndGradBuffer, Planner
from trainer.distributed.layout import default_bucket_size
from trainer.distributed.param_storage import HighPrecisionStorage, ParamStorage
from trainer.distributed.param_sync import SETTLED, ParamSyncError, ParamSyncState
from trainer.parallel.groups import ParallelState
from trainer.main_grad import READY_HOOK, grad_ready, settle_stale
from trainer.switches import switched_off

from moectl.core.config.schema import ParallelConfig

DEFAULT_OPTIMIZER_TAG = "adam"

TagSpec = Callable[[str, torch.nn.Parameter], str] | Mapping[str, str] | None
StorageSpec = Callable[[str, torch.nn.Parameter], ParamStorage] | None


def is_expert_param(param: torch.nn.Parameter) -> bool:
    return bool(getattr(param, "expert_parallel", False))


def stale_capable_params(module: torch.nn.Module) -> frozenset[torch.nn.Parameter]:
    """Params whose layer overwrites a stale grad itself (`trainer.main_grad`), so zero_grad may skip filling
    them: what modules with `stale_grad_params(device)` name (the grouped expert MLP). None under
    MOECTL_STALE_GRADS=0 (or false/off/no: every grad zero-filled, the A/B switch)."""
    if switched_off("MOECTL_STALE_GRADS"):
        return frozenset()
    found: set[torch.nn.Parameter] = set()
    for m in module.modules():
        name_them = getattr(m, "stale_grad_params", None)
        if callable(name_them):
            first = next(m.parameters(), None)
            if first is not None:
                found.update(name_them(first.device))
    return frozenset(found)


def param_runs(module: torch.nn.Module) -> dict[torch.nn.Parameter, tuple[str, tuple[torch.nn.Parameter, ...]]]:
    """Each param of a run (`trainer/distributed/layout.py`) -> (the run's name, its members in order): what
    modules with `param_runs()` name (per-expert params, `GroupedLinearParams.param_runs`), the name being
    the qualified name of the grouped tensor the run stands for."""
    found: dict[torch.nn.Parameter, tuple[str, tuple[torch.nn.Parameter, ...]]] = {}
    for prefix, m in module.named_modules():
        runs_of = getattr(m, "param_runs", None)
        if not callable(runs_of):
            continue
        for leaf, members in runs_of().items():
            run = (f"{prefix}.{leaf}" if prefix else leaf, tuple(members))
            for p in run[1]:
                found[p] = run
    return found


def backward_order(named: list[tuple[str, torch.nn.Parameter]],
                   runs: Mapping[torch.nn.Parameter, tuple[str, tuple[torch.nn.Parameter, ...]]]
                   ) -> list[tuple[str, torch.nn.Parameter]]:
    """`named` (registration order) in the buffers' order: reverse registration, except that the members of a
    run (`param_runs`) come in the run's own order (experts 0..E-1), all at the place of the first of them
    that reverse registration meets. That is where the grouped tensor the run stands for would be: per-expert
    `weight0..weight{E-1}, bias0..bias{E-1}` then lie as the grouped `weight, bias` do, reversed to `bias,
    weight`, each in expert order. Members not in `named` (frozen) are left out."""
    name_of = {p: n for n, p in named}
    placed: set[str] = set()
    order: list[tuple[str, torch.nn.Parameter]] = []
    for name, p in reversed(named):
        run = runs.get(p)
        if run is None:
            order.append((name, p))
        elif run[0] not in placed:
            placed.add(run[0])
            order += [(name_of[q], q) for q in run[1] if q in name_of]
    return order


def _tensor_digest(t: torch.Tensor) -> str:
    data = t.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


class DistributedModel:
    #: default of `coalesce_sync_gather` (tests turn it off to run the per-bucket reference path end to end)
    COALESCE_SYNC_GATHER = True

    def __init__(self, module: torch.nn.Module, parallel_cfg: ParallelConfig, pstate: ParallelState,
                 optimizer_tags: TagSpec = None, storage: StorageSpec = None,
                 layouts: Mapping[str, Planner] | None = None, coalesce_sync_gather: bool | None = None) -> None:
        self.module = module
        self.cfg = parallel_cfg
        self.pstate = pstate
        self.use_distributed_optimizer = parallel_cfg.use_distributed_optimizer
        # The library takes the flags as set, a null as off (Megatron's DDP defaults); the trainer's engine
        # resolves null by the product's policy first (moectl.core.overlap.overlap_policy: on under dp).
        self.overlap_grad_reduce = bool(parallel_cfg.overlap_grad_reduce)
        self.overlap_param_gather = bool(parallel_cfg.overlap_param_gather)
        self._is_last_microbatch = True
        self._owners: dict[str, Any] = {}
        #: issue a synchronous param sync's all-gathers as one coalesced collective per process group
        #: (`start_param_sync`); False: one blocking call per bucket (the bitwise-equal reference path)
        self.coalesce_sync_gather = self.COALESCE_SYNC_GATHER if coalesce_sync_gather is None else coalesce_sync_gather

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.names: dict[torch.nn.Parameter, str] = {p: n for n, p in named}
        self.params_by_name: dict[str, torch.nn.Parameter] = {n: p for n, p in named}
        registration = {p: i for i, (_, p) in enumerate(named)}

        tag_of = self._tag_fn(optimizer_tags)
        storage_of = storage or (lambda name, p: HighPrecisionStorage())
        bucket_size = parallel_cfg.bucket_size or default_bucket_size(pstate.dp.size)

        # Backward order: reverse registration, a run of per-expert params where its grouped tensor would be
        # (`backward_order`). Buffers appear in the order their first param does.
        runs = param_runs(module)
        by_key: "OrderedDict[BufferKey, list[torch.nn.Parameter]]" = OrderedDict()
        storages: dict[BufferKey, ParamStorage] = {}
        for name, p in backward_order(named, runs):
            st = storage_of(name, p)
            grad_dtype = torch.float32 if parallel_cfg.grad_reduce_in_fp32 else p.dtype
            key = BufferKey(st.storage_dtype(p), grad_dtype, is_expert_param(p), tag_of(name, p), st.key)
            by_key.setdefault(key, []).append(p)
            storages.setdefault(key, st)

        # `layouts`: a buffer planner per optimizer tag (Muon's layer-wise one keeps params whole per shard).
        stale_ok = stale_capable_params(module)
        # A run's members share a buffer in practice (one dtype, tag and storage); were they split, each buffer's
        # share is still consecutive there and laid out as one run.
        run_names = {p: run[0] for p, run in runs.items() if p in self.names}
        self.buffers: list[ParamAndGradBuffer] = [
            ParamAndGradBuffer(key, ps, self.names, storages[key], pstate.group_for(key.is_expert), bucket_size,
                               planner=(layouts or {}).get(key.optimizer_tag), stale_ok=stale_ok, runs=run_names)
            for key, ps in by_key.items()
        ]
        self._storage_of: dict[torch.nn.Parameter, ParamStorage] = {
            p: b.storage for b in self.buffers for p in b.params
        }

        grad_scale = 1.0 / pstate.dp.size
        self.bucket_groups: list[BucketGroup] = []
        self._group_of: dict[torch.nn.Parameter, BucketGroup] = {}
        for buf in self.buffers:
            for bucket in buf.buckets:
                g = BucketGroup(len(self.bucket_groups), [bucket], self.use_distributed_optimizer, grad_scale)
                self.bucket_groups.append(g)
                buf.bucket_groups.append(g)
                for p in bucket.params:
                    self._group_of[p] = g

        # Forward order: the order the model first touches a group's params (registration order).
        self.forward_order = sorted(self.bucket_groups, key=lambda g: min(registration[p] for p in g.params))
        self._next_in_forward = {
            g: (self.forward_order[i + 1] if i + 1 < len(self.forward_order) else None)
            for i, g in enumerate(self.forward_order)
        }

        # Params and modules hold their hooks back to this wrapper weakly. Objects that C++ also holds (a
        # param in the autograd graph the last forward's aux losses keep; an expert module an autograd
        # node's ctx keeps) are not traversed by Python's garbage collector, so param or module -> hook ->
        # wrapper -> model was a cycle it never freed: a second Trainer in one process (a bench column, a
        # test) kept the first one's model, grads and optimizer state.
        for p in self.names:
            setattr(p, READY_HOOK, _WeakMethod(self, "_on_grad_ready"))
            p.register_post_accumulate_grad_hook(_WeakMethod(self, "_fold_grad"))

        # Lazy param gather: a module's pre-hook completes the groups of every param in its subtree, so
        # params held by a container that is never called (an expert layer's [E, out, in] weights read by
        # an autograd Function) are ready when the first enclosing module runs. The root completes only
        # its direct params, else the first forward call would gather everything at once (no overlap).
        self._module_groups: dict[torch.nn.Module, list[BucketGroup]] = {}
        if self.overlap_param_gather:
            order = {g: i for i, g in enumerate(self.forward_order)}
            for m in module.modules():
                params = m.parameters(recurse=m is not module)
                groups = {self._group_of[p] for p in params if p in self._group_of}
                if groups:
                    self._module_groups[m] = sorted(groups, key=order.__getitem__)
                    m.register_forward_pre_hook(_WeakMethod(self, "_forward_pre_hook"))  # weak: see above

    # ---------------------------------------------------------------- plumbing
    @staticmethod
    def _tag_fn(spec: TagSpec) -> Callable[[str, torch.nn.Parameter], str]:
        if spec is None:
            return lambda name, p: DEFAULT_OPTIMIZER_TAG
        if callable(spec):
            return spec
        mapping = dict(spec)
        return lambda name, p: mapping.get(name, DEFAULT_OPTIMIZER_TAG)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def group_of(self, param: torch.nn.Parameter) -> BucketGroup:
        return self._group_of[param]

    def groups_for(self, tag: str | None) -> list[BucketGroup]:
        """Bucket groups owned by `tag` (all of them for None), in forward order."""
        return [g for g in self.forward_order if tag is None or g.tag == tag]

    def buffers_for(self, tag: str) -> list[ParamAndGradBuffer]:
        return [b for b in self.buffers if b.key.optimizer_tag == tag]

    def register_optimizer(self, tag: str, owner: Any, stager: Callable[[BucketGroup], None]) -> list[BucketGroup]:
        """Make `owner` the one optimizer that stages and gathers the groups of `tag`.

        Call it once the owner's masters exist: groups of quantized storage are staged and gathered here
        (a collective), so the model's quantized weights exist from then on.
        """
        if tag in self._owners:
            raise ValueError(f"optimizer tag {tag!r} already has an owner; two optimizers cannot step one buffer")
        groups = self.groups_for(tag)
        if not groups:
            raise ValueError(f"no params are tagged {tag!r} (tags: {sorted({g.tag for g in self.bucket_groups})})")
        self._owners[tag] = owner
        for g in groups:
            g.stager = stager
        initial = [g for g in groups if g.storage.needs_initial_sync]
        if initial:  # quantized params hold no values until their first stage + gather (masters exist now)
            with torch.no_grad():
                for g in initial:
                    g.stage()
                self.start_param_sync(force_sync=True, tag=tag)
        return groups

    # ---------------------------------------------------------------- grads
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Run a non-last micro-batch: grads accumulate into main_grad, no reduce is launched."""
        prev = self._is_last_microbatch
        self._is_last_microbatch = False
        try:
            yield
        finally:
            self._is_last_microbatch = prev

    @property
    def is_last_microbatch(self) -> bool:
        return self._is_last_microbatch

    def _fold_grad(self, param: torch.nn.Parameter) -> None:
        """Post-accumulate hook: move an autograd `.grad` into `main_grad`, then report it."""
        if param.grad is None:
            return  # a fused layer accumulated into main_grad and reported already
        settle_stale(param)
        param.main_grad.add_(param.grad)
        param.grad = None
        grad_ready(param)

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        g = self._group_of[param]
        self._check_params_settled(g, param)
        if self.overlap_grad_reduce and self._is_last_microbatch:
            g.grad_ready(param)

    def _check_params_settled(self, g: BucketGroup, param: torch.nn.Parameter) -> None:
        if g.aliases_grad:  # any staged value still in this grad memory would be summed into the grads
            pending = [x for x in g.buckets[0].buffer.bucket_groups if x.state not in SETTLED]
        else:
            pending = [g] if g.state not in SETTLED else []
        if pending:
            raise ParamSyncError(
                f"{self.names[param]} got a grad while {pending[0].name} is {pending[0].state.value}: its forward "
                "ran on stale weights, or staged values sit in the grad buffer (call the module through "
                "__call__ so its pre-hook gathers, or force_param_sync() before running it)"
            )

    def zero_grad_buffer(self) -> None:
        """Zero every grad buffer; then re-stage groups whose staging lives in grad memory.

        Re-staging here makes the Megatron #4987 freeze impossible: with the staging buffer aliased on the
        grad buffer and the gather deferred to the next forward, zeroing grads would otherwise make that
        gather ship zeros.
        """
        for g in self.bucket_groups:
            if g.aliases_grad and g.state in (ParamSyncState.DISPATCHED, ParamSyncState.GATHERED):
                raise ParamSyncError(
                    f"{g.name}: zeroing grads while its gather is {g.state.value} would destroy the values in flight"
                )
        grad_sq.clear()  # their sums of squares go with them
        wgrad_deferral.clear_all()  # and the operands of an interrupted step's deferred expert wgrads
        for g in self.bucket_groups:
            g.reset_grad_sync()
        for buf in self.buffers:
            buf.zero_grad()
        for g in self.bucket_groups:
            if g.aliases_grad and g.state is ParamSyncState.STAGED:
                g.stage()

    def start_grad_sync(self) -> None:
        """Launch the reduce of every group not launched yet (async)."""
        for g in self.bucket_groups:
            g.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Launch what is left and wait for every reduce; call once per step, before the optimizer.

        With `overlap_grad_reduce`, every group must have launched during the last backward. A group
        still waiting means some param got no grad on this rank; launching it now could order this
        rank's collectives differently from the others' (a hang, or buckets reduced into each other),
        so it is an error naming the params, as in Megatron.
        """
        if self.overlap_grad_reduce:
            late = [g for g in self.bucket_groups if g.grad_state is GradSyncState.ACCUMULATING]
            if late:
                missing = sorted(self.names[p] for g in late for p in g.missing_grads())
                raise GradSyncError(
                    f"with overlap_grad_reduce every trainable param must get a grad in the last micro-batch; "
                    f"these did not: {missing[:8]}{' ...' if len(missing) > 8 else ''} (freeze them with "
                    "requires_grad=False, or set parallel.overlap_grad_reduce=false)"
                )
        for g in self.bucket_groups:
            g.finish_grad_sync()

    @property
    def reduces_grads(self) -> bool:
        """Whether any grad reduction moves data (some bucket group spans more than one rank)."""
        return any(g.group.size > 1 for g in self.bucket_groups)

    def mark_grads_reduced(self) -> None:
        """Every group -> `reduced` after a CUDA graph replay that ran the reductions of the last micro-batch
        (launched by its captured hooks, waited at its end): no hook or wait runs in Python at a replay."""
        for g in self.bucket_groups:
            g.mark_reduced()

    def grads_reduced(self, tag: str | None = None) -> bool:
        return all(g.grad_state is GradSyncState.REDUCED for g in self.groups_for(tag))

    # ---------------------------------------------------------------- params
    def _forward_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        for g in self._module_groups[module]:
            if g.state not in SETTLED:
                g.complete_param_sync(force_sync=False, prefetch=self._next_in_forward[g])

    def start_param_sync(self, force_sync: bool = False, tag: str | None = None) -> None:
        """Gather staged groups (of `tag`, or all).

        With `overlap_param_gather` and not `force_sync`: dispatch async gathers; the forward pre-hooks
        wait and post-process. Otherwise: gather synchronously and post-process now, through the same
        `complete_param_sync` as the hooks (a forced sync that skipped post-processing left stale
        weights for the next step, Megatron #4562). Nothing overlaps a synchronous gather, so with
        `coalesce_sync_gather` every staged group's buckets go out together (`dispatch_coalesced`: one
        collective per process group instead of one blocking call per bucket), then each group is waited
        and post-processed in forward order, exactly as one by one.
        """
        if self.overlap_param_gather and not force_sync:
            for g in self.groups_for(tag):
                if g.state is ParamSyncState.STAGED:
                    g.dispatch()
            return
        with torch.no_grad():
            groups = self.groups_for(tag)
            staged = [g for g in groups if g.state is ParamSyncState.STAGED]
            if self.coalesce_sync_gather and staged:
                dispatch_coalesced(staged)  # one collective per process group; waited below, group by group
            for g in groups:
                g.complete_param_sync(force_sync=True)

    @property
    def gathers_in_graph(self) -> bool:
        """Whether a captured forward may hold the param gathers: overlapped gathers (the forward pre-hooks
        launch and wait them) that move data, of high-precision storage only. A quantized storage publishes
        weights that a graph reads from pinned copies refreshed before the step
        (`trainer/graphs/static_weights.py`), so its gather must finish before the step."""
        return (self.overlap_param_gather and any(g.needs_gather for g in self.bucket_groups)
                and all(type(g.storage) is HighPrecisionStorage for g in self.bucket_groups))  # fmt: skip

    def stage_for_graph_gather(self) -> None:
        """Stage every settled group before a replay (or capture) of a forward that gathers: the graph ships
        every group's staged shard, and its capture records a gather only for groups staged then. A group
        settled by a forced sync since the update (eval, a checkpoint, a skipped step) re-stages values the
        update already wrote, so the replay gathers what the params already hold."""
        with torch.no_grad():
            for g in self.bucket_groups:
                if g.state is not ParamSyncState.STAGED:
                    g.stage()

    def mark_params_gathered(self) -> None:
        """Every group `staged -> post_processed` after a replay that gathered them (launched by the captured
        pre-hooks, waited inside the graph; high-precision storage has nothing to post-process)."""
        for g in self.bucket_groups:
            g.mark_gathered()

    def force_param_sync(self) -> None:
        """Make every param current now (eval, checkpoint save, hash checks, exit)."""
        self.start_param_sync(force_sync=True)

    def broadcast_params(self) -> None:
        """Give every replica the params of its group's first rank (dense: dp, expert: expert-dp).

        Call once after init and before building optimizers (masters are built from the params).
        """
        if self._owners:
            raise RuntimeError("broadcast_params() must run before optimizers build their masters")
        with torch.no_grad():
            for buf in self.buffers:
                if not buf.storage.aliases_grad:  # aliased staging is grad memory: nothing to agree on
                    comm.broadcast(buf.param_data, buf.group)
                for p in buf.params:
                    for t in buf.storage.replica_tensors(p):
                        self._broadcast_anywhere(t, buf)
            for p in self.module.parameters():
                if p not in self._group_of:  # frozen params live outside the buffers
                    comm.broadcast(p.data, self.pstate.group_for(is_expert_param(p)))

    @staticmethod
    def _broadcast_anywhere(t: torch.Tensor, buf: ParamAndGradBuffer) -> None:
        """Broadcast `t` over the buffer's group, through the buffer's device when `t` lives elsewhere (a
        quantized param's CPU init copy under NCCL, which sends device tensors only)."""
        if t.device == buf.device or buf.group.pg is None:
            comm.broadcast(t, buf.group)
            return
        staged = t.to(buf.device)
        comm.broadcast(staged, buf.group)
        t.copy_(staged)

    def _digest(self, p: torch.nn.Parameter) -> str:
        """sha256 of a param's live values: its storage's tensors (a quantized param's bytes and scales)."""
        storage = self._storage_of.get(p)
        if storage is None:
            return _tensor_digest(p)
        h = hashlib.sha256()
        for t in storage.digest_tensors(p):
            h.update(_tensor_digest(t).encode())
        return h.hexdigest()

    def check_param_hashes(self) -> list[str]:
        """Names of params that differ between replicas (dense: all dp ranks; expert: same ep rank).

        Compares what each param's storage holds live (for quantized params the bytes the forward reads).
        Collective; every rank returns the same list (empty when all replicas agree).
        """
        local = {n: self._digest(p) for n, p in self.module.named_parameters()}
        expert = {n for n, p in self.module.named_parameters() if is_expert_param(p)}
        everyone = comm.all_gather_object((self.pstate.ep_rank, local), self.pstate.dp)
        bad = []
        for name in local:
            if name in expert:
                by_ep: dict[int, set[str]] = {}
                for ep_rank, digests in everyone:
                    by_ep.setdefault(ep_rank, set()).add(digests.get(name, ""))
                if any(len(v) > 1 for v in by_ep.values()):
                    bad.append(name)
            elif len({digests.get(name, "") for _, digests in everyone}) > 1:
                bad.append(name)
        return sorted(bad)


class _WeakMethod:
    """`obj.<name>(*args)` through a weak reference to `obj` (a no-op once `obj` is gone)."""

    def __init__(self, obj: Any, name: str) -> None:
        self.ref = weakref.ref(obj)
        self.name = name

    def __call__(self, *args: Any) -> Any:
        obj = self.ref()
        return None if obj is None else getattr(obj, self.name)(*args)

