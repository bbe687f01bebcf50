"""Live training state <-> the checkpoint format: what `train` saves and what resume loads.

Saved, as logical (unsharded, un-padded, expert-parallel-gathered) tensors under the model's state-dict
names: model weights (high precision; quantized bytes are never saved, they are rebuilt from masters),
and per param `<name>.main_param` (fp32 master), `<name>.exp_avg`, `<name>.exp_avg_sq` (AdamW) or
`<name>.momentum_buffer` (Muon's matrices), whichever the optimizer holds for it. Ranks split the
tensor names between them and write their own `model-/optim-<rank>.safetensors` files in parallel.

Loading goes through `ckpt.layout.normalize_for_model`, the one normalisation shared with `convert` and
`load_main_params_from_ckpt`: a checkpoint of the other expert layout or fc1 interleave loads as if it
had been saved by this model. Then each rank keeps only its own slices: its experts under expert
parallelism, its shard ranges of the masters (the optimizer slices full tensors itself).
Limitation, stated: every rank holds the full logical state while saving (the optimizer gathers it).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ckpt.layout import PER_EXPERT, SINGLE_GROUPED, normalize_for_model
from ckpt.reader import Checkpoint, open_checkpoint
from ckpt.save import save_checkpoint
from moectl.config.load import config_to_dict
from moectl.config.schema import Config
from moectl.errors import CheckpointError

STATE_SUFFIX = {"master": ".main_param", "exp_avg": ".exp_avg", "exp_avg_sq": ".exp_avg_sq",
                "momentum_buffer": ".momentum_buffer"}
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
# The model keys a checkpoint must agree on to load into a model at all (shapes follow from these).
ARCH_KEYS = {
    "model": ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "vocab_size", "moe_layer_freq", "tie_embeddings", "qk_layernorm"),
    "moe": ("num_experts", "ffn_hidden_size", "activation", "add_bias"),
}  # fmt: skip
_MEMBER_RE = re.compile(r"^(?P<stem>.+\.experts\.linear_fc[12]\.(?:weight|bias))(?P<index>\d+)$")


def expert_layouts(cfg: Config) -> tuple[str, str]:
    """(weight layout, bias layout) of models built from `cfg`."""
    w = SINGLE_GROUPED if cfg.moe.single_grouped_weight else PER_EXPERT
    b = SINGLE_GROUPED if (cfg.moe.single_grouped_weight and cfg.moe.single_grouped_bias) else PER_EXPERT
    return w, b


def recipe_meta(cfg: Config) -> dict[str, Any]:
    """The precision recipe as manifest data."""
    mp = cfg.mixed_precision
    return {"bf16": mp.bf16, "fp8": mp.fp8, "fp8_recipe": mp.fp8_recipe if mp.fp8 else None,
            "fp4": mp.fp4, "fp4_recipe": mp.fp4_recipe if mp.fp4 else None,
            "fp8_param_gather": mp.fp8_param_gather, "fp4_param_gather": mp.fp4_param_gather}  # fmt: skip


# --- expert parallelism: local names <-> global (logical) names -------------------------------------
def _ep(pstate: Any) -> tuple[int, int, Any]:
    ep = pstate.ep if pstate is not None else None
    return (ep.size, ep.rank, ep) if ep is not None else (1, 0, None)


def _is_expert(name: str) -> bool:
    return ".experts.linear_fc" in name


def globalize(tensors: dict[str, torch.Tensor], pstate: Any, num_experts: int) -> dict[str, torch.Tensor]:
    """Local (this ep rank's experts) -> logical tensors: all-gather expert tensors over the ep group."""
    size, rank, group = _ep(pstate)
    if size == 1:
        return dict(tensors)
    n_local = num_experts // size
    out: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):  # the same order on every rank: the gathers pair up
        t = tensors[name]
        if not _is_expert(name):
            out[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group.pg)
        base = _base(name)
        m = _MEMBER_RE.match(base)
        if m is None:  # grouped: [E_local, ...] -> [E, ...]
            out[name] = torch.cat(parts, dim=0)
        else:  # per-expert: local index i on rank r is global index r * n_local + i
            i = int(m.group("index"))
            suffix = name[len(base):]
            for r, part in enumerate(parts):
                out[f"{m.group('stem')}{r * n_local + i}{suffix}"] = part
    return out


def localize(tensors: dict[str, torch.Tensor], pstate: Any, num_experts: int, local_names: set[str]) -> dict[str, torch.Tensor]:
    """Logical tensors (in the model's layout) -> this ep rank's: slice grouped experts, renumber members."""
    size, rank, _ = _ep(pstate)
    if size == 1:
        return {k: v for k, v in tensors.items() if _base(k) in local_names}
    n_local = num_experts // size
    lo, hi = rank * n_local, (rank + 1) * n_local
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        base = _base(name)
        suffix = name[len(base):]
        m = _MEMBER_RE.match(base)
        if _is_expert(base) and m is None:
            out[name] = t[lo:hi]
        elif m is not None:
            g = int(m.group("index"))
            if lo <= g < hi:
                out[f"{m.group('stem')}{g - lo}{suffix}"] = t
        elif base in local_names:
            out[name] = t
    return out


def _base(name: str) -> str:
    for suffix in STATE_SUFFIX.values():
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


# --- saving ------------------------------------------------------------------------------------------
def collect_logical_state(model: nn.Module, engine: Any, pstate: Any, num_experts: int) -> dict[str, torch.Tensor]:
    """Model weights and optimizer state as logical tensors (a collective: call on every rank)."""
    engine.sync_params_for_eval()  # params equal the masters, with any deferred gather finished
    from trainer.distributed.quantized_storage import quantized_storage_of

    params = dict(model.named_parameters())
    local: dict[str, torch.Tensor] = {n: p.detach() for n, p in params.items()}
    optimizer = getattr(engine, "optimizer", None)
    if hasattr(optimizer, "gather_logical_state"):
        state = optimizer.gather_logical_state()
        for name, entry in state["params"].items():
            for key, suffix in STATE_SUFFIX.items():
                if key in entry:  # AdamW params have moments, Muon matrices a momentum buffer
                    local[name + suffix] = entry[key]
            if quantized_storage_of(params[name]) is not None:
                # fp8/fp4 param gather: the model holds only quantized bytes (its param is a placeholder);
                # save the weight a run without param gather would hold, the master cast to the param dtype
                local[name] = entry["master"].to(params[name].dtype)
    else:  # SGD on one process: the params are the masters
        for n, p in model.named_parameters():
            local[n + STATE_SUFFIX["master"]] = p.detach().float()
    return globalize(local, pstate, num_experts)


def _split_between_ranks(names: list[str], sizes: dict[str, int], world: int) -> list[list[str]]:
    """Greedy size balance, deterministic: every rank computes the same split."""
    loads, parts = [0] * world, [[] for _ in range(world)]
    for name in sorted(names, key=lambda n: (-sizes[n], n)):
        r = loads.index(min(loads))
        parts[r].append(name)
        loads[r] += sizes[name]
    return parts


def _rng_state() -> dict[str, Any]:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def save_training_checkpoint(
    root: Path,
    step: int,
    cfg: Config,
    model: nn.Module,
    engine: Any,
    pstate: Any,
    probe_loss: float,
    *,
    optimizer_step: int,
) -> Path:
    """Save `step` collectively under `root` (every rank calls this); returns the committed folder."""
    tensors = collect_logical_state(model, engine, pstate, cfg.moe.num_experts)
    world = pstate.world_size if pstate is not None else 1
    rank = pstate.rank if pstate is not None else 0
    mine = _split_between_ranks(list(tensors), {n: t.numel() * t.element_size() for n, t in tensors.items()}, world)[rank]
    model_part = {n: tensors[n] for n in mine if _base(n) == n}
    optim_part = {n: tensors[n] for n in mine if _base(n) != n}
    files = {}
    if model_part:
        files[f"model-{rank:05d}.safetensors"] = model_part
    if optim_part:
        files[f"optim-{rank:05d}.safetensors"] = optim_part
    layout, _ = expert_layouts(cfg)
    meta = {
        "consumed_samples": step * cfg.train.global_batch_size,
        "config": config_to_dict(cfg),
        "expert_layout": layout,
        "glu_interleave_size": cfg.moe.glu_interleave_size,
        "recipe": recipe_meta(cfg),
        "world": {"dp": world, "ep": cfg.parallel.expert_model_parallel_size,
                  "owners": _owners(tensors)},
        "sampler": {"seed": cfg.train.seed, "step": step, "global_batch_size": cfg.train.global_batch_size},
        "rng": _rng_state(),
        "probe": {"loss": probe_loss, "loss_hex": float(probe_loss).hex(), "batch": "eval window 0, dp=1"},
        "train_state": {"step": step, "optimizer_step": optimizer_step},
    }  # fmt: skip
    group = pstate.dp if pstate is not None and world > 1 else None
    return save_checkpoint(root, step, files, meta, group=group.pg if group is not None else None,
                           keep_last=cfg.checkpoint.keep_last)


def _owners(tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Param names per optimizer: Muon's have a momentum buffer, AdamW's (the rest with a master) do not."""
    momentum = STATE_SUFFIX["momentum_buffer"]
    muon = sorted(_base(n) for n in tensors if n.endswith(momentum))
    adam = sorted(set(_base(n) for n in tensors if n.endswith(STATE_SUFFIX["master"])) - set(muon))
    return {"adam": adam, "muon": muon} if muon else {"adam": adam}


# --- loading -----------------------------------------------------------------------------------------
def _moment_keys(engine: Any, name: str) -> tuple[str, ...]:
    """The optimizer state `name` needs besides its master: what the optimizer says, else AdamW's moments."""
    keys = getattr(getattr(engine, "optimizer", None), "state_keys", None)
    return tuple(k for k in keys(name) if k != "master") if keys is not None else ADAM_MOMENTS


@dataclass
class Restored:
    """Where a resumed run continues."""

    step: int
    consumed_samples: int
    path: Path
    optimizer_state: bool  # moments and step count came from the checkpoint


def check_architecture(saved: dict[str, Any], cfg: Config) -> None:
    """Refuse a checkpoint whose model cannot have these shapes, naming every differing key."""
    diffs = []
    for section, keys in ARCH_KEYS.items():
        for key in keys:
            a, b = saved.get(section, {}).get(key), getattr(getattr(cfg, section), key)
            if a != b:
                diffs.append(f"{section}.{key}: checkpoint {a!r}, config {b!r}")
    if diffs:
        raise CheckpointError(
            "the checkpoint's model does not match the config: " + "; ".join(diffs),
            "load it with its own config (moectl ckpt inspect shows it), or fix these keys",
        )


def read_logical(ck: Checkpoint, cfg: Config, wanted: Optional[set[str]] = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors normalised to `cfg`'s expert layout and fc1 interleave.

    `wanted` filters non-expert tensors by param name; expert tensors are always read (a rank's
    experts are sliced out after normalisation, whatever the saved layout).
    """
    names = [n for n in ck.tensor_names() if wanted is None or _base(n) in wanted or _is_expert(n)]
    raw = {n: ck.read(n) for n in names}
    layout, bias_layout = expert_layouts(cfg)
    return normalize_for_model(
        raw,
        num_experts=cfg.moe.num_experts,
        target_layout=layout,
        target_bias_layout=bias_layout,
        source_interleave=ck.meta.get("glu_interleave_size"),
        target_interleave=cfg.moe.glu_interleave_size,
        ffn_size=cfg.moe.ffn_hidden_size,
    )


def load_training_checkpoint(path: str | Path, cfg: Config, model: nn.Module, engine: Any, pstate: Any) -> Restored:
    """Restore model, masters and (unless `checkpoint.no_load_optim`) moments; return where to resume.

    - default: masters and moments from the checkpoint; params rebuilt from the masters;
    - `no_load_optim` + `load_main_params_from_ckpt`: masters from the checkpoint, fresh moments;
    - `no_load_optim` alone: masters from the checkpoint's model weights (what Megatron does), fresh moments.
    """
    ck = open_checkpoint(path, verify=True)
    check_architecture(ck.meta.get("config", {}), cfg)
    local_names = {n for n, _ in model.named_parameters()}
    logical = read_logical(ck, cfg, wanted=local_names)
    tensors = localize(logical, pstate, cfg.moe.num_experts, local_names)
    ccfg = cfg.checkpoint
    load_optim = not ccfg.no_load_optim
    masters_from_ckpt = load_optim or ccfg.load_main_params_from_ckpt
    params: dict[str, dict[str, torch.Tensor]] = {}
    missing = []
    for name in sorted(local_names):
        entry = {}
        master = tensors.get(name + STATE_SUFFIX["master"]) if masters_from_ckpt else tensors.get(name)
        if master is None:
            missing.append(name + (STATE_SUFFIX["master"] if masters_from_ckpt else ""))
            continue
        if masters_from_ckpt and master.dtype != torch.float32:
            raise CheckpointError(
                f"tensor {name}.main_param is {master.dtype}, not float32: loading it would narrow the fp32 master",
                "load a checkpoint written by moectl train (fp32 masters), or set checkpoint.no_load_optim=true",
            )
        entry["master"] = master.float()
        if load_optim:
            for key in _moment_keys(engine, name):
                t = tensors.get(name + STATE_SUFFIX[key])
                if t is None:
                    missing.append(name + STATE_SUFFIX[key])
                else:
                    entry[key] = t
        params[name] = entry
    if missing:
        raise CheckpointError(
            f"checkpoint {ck.path} lacks {len(missing)} tensor(s) this model needs: {', '.join(missing[:5])}"
            + (" ..." if len(missing) > 5 else ""),
            "load a checkpoint of this model, or set checkpoint.no_load_optim=true to skip optimizer state",
        )
    train_state = ck.meta.get("train_state", {})
    state: dict[str, Any] = {"params": params}
    if load_optim:
        state["step"] = int(train_state.get("optimizer_step", ck.step))
    optimizer = getattr(engine, "optimizer", None)
    if hasattr(optimizer, "load_logical_state"):
        optimizer.load_logical_state(state)
    else:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n]["master"])
    rng = ck.meta.get("rng", {})
    if "torch" in rng:
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng["torch"])), dtype=torch.uint8))
    return Restored(step=ck.step, consumed_samples=int(ck.meta.get("consumed_samples", 0)), path=ck.path,
                    optimizer_state=load_optim)
