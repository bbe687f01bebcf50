"""Delayed scaling's amax histories in a checkpoint: a resumed fp8 run quantizes with the scales it had.

Delayed scaling (`trainer.precision.recipes.delayed`) picks each tensor's encode scale from a window of past
amaxes. Without the windows a resumed run starts from empty ones, so its first step quantizes every operand
with scale 1 (grads of ~1e-5 flush to zero in fp8, activations beyond 448 saturate) and the run departs
from the uninterrupted one. TE saves the same state with its modules (`extra_state`, the fp8 meta); here it
travels in the manifest's meta (`scaling`): a few floats per layer and expert.

Entries, by name:
- `<module>.<key>.<role>`: a `Linear`'s `recipe_state` (no key), a `GroupedMLP`'s `recipe_states` (key `fc1`,
  `fc2`: one entry per expert; `fc1.<e>` for the per-expert loop), roles `input`, `weight`, `grad`;
- `<module>.gathered`: a quantized param storage's weight history per owner module (fp8 param gather), with
  `used`, the encode scales that quantized the saved masters. Loading stages the masters again: the storage
  then quantizes with `used` and records nothing (the saved window already holds that amax), as the
  uninterrupted run did;
- each field (`history` `[L, *shape]`, `scale` and `used` `[*shape]`) fp32, raw bytes in base64 (exact).

The histories of activations and grads are per rank (each rank sees its own tokens). A checkpoint holds one
value per name: expert entries gathered over the expert-parallel group into global expert order, then the
element-wise max of the histories and min of the scales over every rank (the most conservative window; the
run's own when the ranks agree, as on one rank). Which windows have an expert axis is decided by module type
(`GroupedMLP`, `GroupedLinearParams`), the same on every rank.

Loading (any load of a checkpoint that has them, with or without optimizer state: they are the model's
quantizers' state): slices this rank's experts; converts between the grouped backends' form and the
per-expert loop's when the run changed backend, and makes only the states of the form it uses; keeps the
newest `L` entries (zeros where the saved window is shorter); recomputes each scale from the window with
this run's format (a `hybrid` checkpoint resumed as `e4m3` gets e4m3 grad scales; the same format gives the
saved scales bit for bit); and creates the states not made yet (they are made on first use). A checkpoint
without the meta (another recipe, an older moectl) leaves the fresh windows.
"""

from __future__ import annotations

import base64
import re
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from trainer.kernels.fp8_scale import scale_from_amax
from trainer.parallel.groups import ParallelState
from trainer.precision.recipes.delayed import AmaxHistory, DelayedRecipe, DelayedState

META_KEY = "scaling"
_ROLES = ("input", "weight", "grad")
_GATHERED = "gathered"
_LOOP_KEY = re.compile(r"^fc\d\.\d+$")  # the per-expert loop's state keys (`fc1.3`)
_REDUCE = {"history": dist.ReduceOp.MAX, "scale": dist.ReduceOp.MIN, "used": dist.ReduceOp.MIN}
_NEUTRAL = {"history": 0.0, "scale": float("inf"), "used": float("inf")}

Entry = dict[str, torch.Tensor]  # field -> fp32 tensor


# --- where the windows live ------------------------------------------------------------------------------
def _module_states(model: nn.Module) -> Iterator[tuple[str, nn.Module, dict[str, Any]]]:
    """(module name, module, {key: recipe state}) of every module that holds delayed-scaling states."""
    from trainer.linear import Linear
    from trainer.moe.experts import GroupedMLP

    for name, m in model.named_modules():
        if isinstance(m, Linear) and isinstance(m.recipe_state, DelayedState):
            yield name, m, {"": m.recipe_state}
        elif isinstance(m, GroupedMLP) and isinstance(m.recipe, DelayedRecipe):
            yield name, m, m.recipe_states


def _storages(model: nn.Module) -> list[Any]:
    """The quantized param storages of `model` that keep delayed weight histories (fp8 param gather)."""
    from trainer.distributed.quantized_storage import quantized_storage_of

    seen: dict[int, Any] = {}
    for p in model.parameters():
        s = quantized_storage_of(p)
        if s is not None and getattr(s, "delayed", False):
            seen.setdefault(id(s), s)
    return list(seen.values())


def _owners(storage: Any) -> list[nn.Module]:
    """The modules whose weights share a delayed history in `storage`."""
    out: list[nn.Module] = []
    for p in storage.sites:
        owner = storage.site(p).owner
        if isinstance(owner, nn.Module) and all(owner is not o for o in out):
            out.append(owner)
    return out


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _n_local(model: nn.Module) -> int:
    from trainer.moe.experts import GroupedMLP

    return next((m.num_local_experts for m in model.modules() if isinstance(m, GroupedMLP)), 1)


def _expert_modules(model: nn.Module) -> tuple[str, ...]:
    """Names of the modules whose windows have one entry per expert (grouped experts, their weight holders)."""
    from trainer.moe.experts import GroupedLinearParams, GroupedMLP

    return tuple(n for n, m in model.named_modules() if isinstance(m, (GroupedMLP, GroupedLinearParams)))


def _expert_axis(name: str, history: torch.Tensor, expert_modules: tuple[str, ...]) -> bool:
    """Whether a window's last axis counts experts: a non-scalar window of an expert module."""
    return history.dim() > 1 and any(name.startswith(m + ".") for m in expert_modules)


def _global_name(name: str, ep_rank: int, n_local: int) -> str:
    """A per-expert-loop state's name with its global expert index (`...experts.fc1.<e>.input`)."""
    parts = name.split(".")
    for i in range(len(parts) - 2):
        if _LOOP_KEY.match(f"{parts[i]}.{parts[i + 1]}") and parts[i + 2] in _ROLES:
            parts[i + 1] = str(ep_rank * n_local + int(parts[i + 1]))
    return ".".join(parts)


# --- saving ----------------------------------------------------------------------------------------------
def _copies(**fields: torch.Tensor) -> Entry:
    """fp32 copies: the collectives of a save reduce them in place, never the live windows."""
    return {f: t.detach().float().clone() for f, t in fields.items()}


def local_entries(model: nn.Module) -> dict[str, Entry]:
    """Every materialised window of `model` by local name (this rank's expert indices)."""
    out: dict[str, Entry] = {}
    for name, _, states in _module_states(model):
        for key, st in states.items():
            if not isinstance(st, DelayedState):
                continue
            for role in _ROLES:
                h: AmaxHistory = getattr(st, role)
                if h.history is not None and h.scale is not None:
                    out[_join(name, key, role)] = _copies(history=h.history, scale=h.scale)
    names = {m: n for n, m in model.named_modules()}
    for storage in _storages(model):
        for owner in _owners(storage):
            h = storage.histories.get(owner)
            params = storage.owner_params(owner)
            if h is None or h.history is None or owner not in names or any(p not in storage.scales for p in params):
                continue
            used = torch.cat([storage.scales[p].reshape(-1).float() for p in params]).reshape(h.scale.shape)
            out[_join(names[owner], _GATHERED)] = _copies(history=h.history, scale=h.scale, used=used)
    return out


def _encode(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().to(torch.float32).cpu().contiguous()
    return {"shape": list(t.shape), "data": base64.b64encode(t.numpy().tobytes()).decode()}


def _decode(field: dict[str, Any]) -> torch.Tensor:
    raw = bytearray(base64.b64decode(field["data"]))
    return torch.frombuffer(raw, dtype=torch.float32).reshape(field["shape"]).clone()


def _all_gather_last(t: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def export_scaling(model: nn.Module, pstate: Optional[ParallelState]) -> Optional[dict[str, Any]]:
    """The checkpoint's `scaling` meta of `model` (None without delayed-scaling windows). Collective over the
    world when torch.distributed runs (every rank calls it and gets the same value)."""
    if not any(True for _ in _module_states(model)) and not _storages(model):
        return None  # no delayed scaling in this run (the config's choice, so every rank returns here)
    multi = pstate is not None and pstate.world_size > 1 and dist.is_initialized()
    ep = pstate.ep if multi else None  # type: ignore[union-attr]
    ep_rank, n_local, experts = (ep.rank if ep is not None else 0), _n_local(model), _expert_modules(model)
    entries = {_global_name(n, ep_rank, n_local): e for n, e in local_entries(model).items()}
    if multi:
        # One list of names on every rank (a per-expert loop's states differ by ep rank), so the collectives
        # pair up; a rank without an entry takes part with neutral values.
        shapes: list[Any] = [None] * pstate.world_size  # type: ignore[union-attr]
        dist.all_gather_object(shapes, {n: {f: list(t.shape) for f, t in e.items()} for n, e in entries.items()})
        union: dict[str, dict[str, list[int]]] = {}
        for d in shapes:
            union.update(d)
        device = pstate.device  # type: ignore[union-attr]
        for n in sorted(union):
            entry = entries.get(n) or {f: torch.full(s, _NEUTRAL[f], device=device) for f, s in union[n].items()}
            if ep is not None and ep.size > 1 and _expert_axis(n, entry["history"], experts):  # [.., E_loc] -> [.., E]
                entry = {f: _all_gather_last(entry[f], ep.pg, ep.size) for f in sorted(entry)}
            for f in sorted(entry):
                dist.all_reduce(entry[f], op=_REDUCE[f])
            entries[n] = entry
    if not entries:
        return None
    return {n: {f: _encode(t) for f, t in e.items()} for n, e in sorted(entries.items())}


# --- loading ---------------------------------------------------------------------------------------------
def _fit(saved: torch.Tensor, length: int) -> torch.Tensor:
    """The newest `length` entries of a saved `[L, ...]` window, zero-padded when it is shorter."""
    if saved.shape[0] >= length:
        return saved[:length].clone()
    pad = torch.zeros((length - saved.shape[0], *saved.shape[1:]), dtype=saved.dtype)
    return torch.cat((saved, pad))


def _decode_entry(fields: dict[str, Any]) -> Entry:
    return {f: _decode(v) for f, v in fields.items()}


def _expert_windows(saved: dict[str, Any], name: str, loop: bool, n_experts: int) -> dict[str, Entry]:
    """A GroupedMLP's saved windows in the form its backend keeps them, in global expert order: one window per
    `fc`/role with an expert axis (grouped backends), or one per expert (`fc1.<e>`, the per-expert loop),
    whichever form the checkpoint has (a run may switch backends)."""
    out: dict[str, Entry] = {}
    for fc in ("fc1", "fc2"):
        for role in _ROLES:
            whole = saved.get(f"{name}.{fc}.{role}")
            per = [saved.get(f"{name}.{fc}.{e}.{role}") for e in range(n_experts)]
            if whole is not None:
                entry = _decode_entry(whole)
                if not loop:
                    out[f"{name}.{fc}.{role}"] = entry
                elif entry["scale"].shape == (n_experts,):
                    for e in range(n_experts):
                        out[f"{name}.{fc}.{e}.{role}"] = {f: t[..., e].contiguous() for f, t in entry.items()}
            elif all(p is not None for p in per):
                entries = [_decode_entry(p) for p in per]
                if loop:
                    out.update({f"{name}.{fc}.{e}.{role}": entries[e] for e in range(n_experts)})
                elif all(x["scale"].dim() == 0 for x in entries):
                    out[f"{name}.{fc}.{role}"] = {f: torch.stack([x[f] for x in entries], dim=-1) for f in entries[0]}
    return out


def _put(h: AmaxHistory, entry: Entry, device: torch.device) -> bool:
    """Set one window; the scale is recomputed from the fitted window with this run's format (a checkpoint of
    another fp8 format or window length keeps only its amaxes), the saved one kept where the window has no
    finite amax yet (as `AmaxHistory.record` keeps its scale), 1 where that is not finite either."""
    if tuple(entry["scale"].shape) != tuple(h.shape):
        return False
    history = _fit(entry["history"], h.length)
    window = history.amax(dim=0)
    saved = torch.where(torch.isfinite(entry["scale"]), entry["scale"], torch.ones_like(entry["scale"]))
    keep = (window == 0) | ~torch.isfinite(window)
    h.history = history.to(device)
    h.scale = torch.where(keep, saved, scale_from_amax(window, h.fmax)).to(device)
    return True


def restore_scaling(model: nn.Module, meta: dict[str, Any], pstate: Optional[ParallelState],
                    masters_restored: bool = True) -> int:  # fmt: skip
    """Set `model`'s delayed-scaling windows from a checkpoint's meta (`META_KEY`) before its masters are loaded
    (the load stages them: see the module docstring); returns how many windows were set. `masters_restored`:
    the masters the load stages are the saved ones, so a storage quantizes them with the scales the saved run
    used (else it records their amaxes as usual). Entries of modules the model does not have, or of another
    shape, are skipped."""
    from trainer.moe.experts import GroupedMLP

    saved: dict[str, Any] = meta.get(META_KEY) or {}
    if not saved:
        return 0
    ep = pstate.ep if pstate is not None else None
    ep_size, ep_rank = (ep.size, ep.rank) if ep is not None else (1, 0)
    n_local, experts = _n_local(model), _expert_modules(model)

    def local(gname: str, entry: Entry) -> Entry:  # this rank's experts of a window with an expert axis
        if ep_size > 1 and _expert_axis(gname, entry["history"], experts):
            return {f: t[..., ep_rank * n_local:(ep_rank + 1) * n_local] for f, t in entry.items()}
        return entry

    restored = 0
    for name, m, states in _module_states(model):
        device = next(m.parameters()).device
        if not isinstance(m, GroupedMLP):  # a Linear: one state
            for role in _ROLES:
                gname = _join(name, role)
                if gname in saved and _put(getattr(states[""], role), _decode_entry(saved[gname]), device):
                    restored += 1
            continue
        loop = m.backend(device).name == "loop"
        windows = _expert_windows(saved, name, loop, n_local * ep_size)
        keys = [f"{fc}.{e}" for fc in ("fc1", "fc2") for e in range(n_local)] if loop else ["fc1", "fc2"]
        for key in keys:
            names = {role: _global_name(_join(name, key, role), ep_rank, n_local) for role in _ROLES}
            if not any(g in windows for g in names.values()):
                continue
            if key not in states:  # made on first use: make it now, in the form this backend uses
                states[key] = m.recipe.new_state(None if loop else m.num_local_experts)
            for role, gname in names.items():
                if gname in windows and _put(getattr(states[key], role), local(gname, windows[gname]), device):
                    restored += 1
    names_of = {m: n for n, m in model.named_modules()}
    for storage in _storages(model):
        for owner in _owners(storage):
            gname = _join(names_of.get(owner, "?"), _GATHERED)
            if gname not in saved:
                continue
            params = storage.owner_params(owner)
            entry = local(gname, _decode_entry(saved[gname]))
            if _put(storage.owner_history(owner, params), entry, params[0].device):
                if masters_restored:
                    storage.pending_scales[owner] = entry["used"].to(params[0].device)
                restored += 1
    return restored
