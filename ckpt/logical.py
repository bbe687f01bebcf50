"""A training checkpoint's logical tensors: their names, how expert-parallel shards map onto them, its meta.

Saved, as logical (unsharded, un-padded, expert-parallel-gathered) tensors under the model's state-dict
names: model weights (high precision; quantized bytes are never saved, they are rebuilt from masters),
and per param `<name>.main_param` (fp32 master), `<name>.exp_avg`, `<name>.exp_avg_sq` (AdamW) or
`<name>.momentum_buffer` (Muon's matrices), whichever the optimizer holds for it. Ranks split the
tensor names between them and write their own `model-/optim-<rank>.safetensors` files in parallel.

Loading goes through `ckpt.layout.normalize_for_model`, the one normalisation shared with `convert` and
`load_main_params_from_ckpt`: a checkpoint of the other expert layout or fc1 interleave loads as if it
had been saved by this model. Then each rank keeps only its own slices: its experts under expert
parallelism, its shard ranges of the masters (the optimizer slices full tensors itself).

This is the format's side only: it knows configs, names and tensors, never the engine. The engine's
side (what a live model and optimizer hand over, and take back) is `trainer/checkpointing/`.
Limitation, stated: every rank holds the full logical state while saving (the optimizer gathers it).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from ckpt.layout import PER_EXPERT, SINGLE_GROUPED, normalize_for_model
from ckpt.reader import Checkpoint, open_checkpoint
from moectl.core.config import config_to_dict
from moectl.core.config.schema import Config
from moectl.core.errors import CheckpointError
from moectl.core.rules import fmt

STATE_SUFFIX = {"master": ".main_param", "exp_avg": ".exp_avg", "exp_avg_sq": ".exp_avg_sq",
                "momentum_buffer": ".momentum_buffer"}
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
# The model keys a checkpoint must agree on to load into a model at all (shapes follow from these).
ARCH_KEYS = {
    "model": ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
              "vocab_size", "moe_layer_freq", "tie_embeddings", "qk_layernorm"),
    "moe": ("num_experts", "ffn_hidden_size", "activation", "add_bias"),
}  # fmt: skip
# Meta a checkpoint passes on to the checkpoints a run from it saves (see ckpt.manifest.META_OPTIONAL).
CARRIED_META = ("hf",)
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


def probe_meta(loss: float) -> dict[str, Any]:
    """The manifest's `probe`: the LM loss of the fixed probe batch (exactly, as hex too)."""
    return {"loss": loss, "loss_hex": float(loss).hex(), "batch": "eval window 0, dp=1"}


# --- expert parallelism: local names <-> global (logical) names -------------------------------------
class ExpertGroup(Protocol):
    """The expert-parallel process group of this rank: its size, its rank in it, and the torch group."""

    size: int
    rank: int
    pg: Any


def _ep(ep: Optional[ExpertGroup]) -> tuple[int, int, Any]:
    return (ep.size, ep.rank, ep) if ep is not None else (1, 0, None)


def is_expert(name: str) -> bool:
    """Whether a tensor name is a routed expert's (fc1/fc2 weight or bias, either layout)."""
    return ".experts.linear_fc" in name


def globalize(tensors: dict[str, torch.Tensor], ep: Optional[ExpertGroup], num_experts: int) -> dict[str, torch.Tensor]:
    """Local (this ep rank's experts) -> logical tensors: all-gather expert tensors over the ep group."""
    size, rank, group = _ep(ep)
    if size == 1:
        return dict(tensors)
    n_local = num_experts // size
    out: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):  # the same order on every rank: the gathers pair up
        t = tensors[name]
        if not is_expert(name):
            out[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group.pg)
        base = base_name(name)
        m = _MEMBER_RE.match(base)
        if m is None:  # grouped: [E_local, ...] -> [E, ...]
            out[name] = torch.cat(parts, dim=0)
        else:  # per-expert: local index i on rank r is global index r * n_local + i
            i = int(m.group("index"))
            suffix = name[len(base):]
            for r, part in enumerate(parts):
                out[f"{m.group('stem')}{r * n_local + i}{suffix}"] = part
    return out


def localize(tensors: dict[str, torch.Tensor], ep: Optional[ExpertGroup], num_experts: int,
             local_names: set[str]) -> dict[str, torch.Tensor]:
    """Logical tensors (in the model's layout) -> this ep rank's: slice grouped experts, renumber members."""
    size, rank, _ = _ep(ep)
    if size == 1:
        return {k: v for k, v in tensors.items() if base_name(k) in local_names}
    n_local = num_experts // size
    lo, hi = rank * n_local, (rank + 1) * n_local
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        base = base_name(name)
        suffix = name[len(base):]
        m = _MEMBER_RE.match(base)
        if is_expert(base) and m is None:
            out[name] = t[lo:hi]
        elif m is not None:
            g = int(m.group("index"))
            if lo <= g < hi:
                out[f"{m.group('stem')}{g - lo}{suffix}"] = t
        elif base in local_names:
            out[name] = t
    return out


def base_name(name: str) -> str:
    """The param a tensor name belongs to: `x.weight.exp_avg` -> `x.weight`."""
    for suffix in STATE_SUFFIX.values():
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


# --- saving ------------------------------------------------------------------------------------------
def flatten_state(params: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-param entries (`param`, `master`, moments) -> flat tensor names: `x.weight`, `x.weight.main_param`, ..."""
    flat: dict[str, torch.Tensor] = {}
    for name, entry in params.items():
        if "param" in entry:
            flat[name] = entry["param"]
        for key, suffix in STATE_SUFFIX.items():
            if key in entry:  # AdamW params have moments, Muon matrices a momentum buffer
                flat[name + suffix] = entry[key]
    return flat


def split_between_ranks(names: list[str], sizes: dict[str, int], world: int) -> list[list[str]]:
    """Greedy size balance, deterministic: every rank computes the same split."""
    loads, parts = [0] * world, [[] for _ in range(world)]
    for name in sorted(names, key=lambda n: (-sizes[n], n)):
        r = loads.index(min(loads))
        parts[r].append(name)
        loads[r] += sizes[name]
    return parts


def rank_files(tensors: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's share of the logical tensors, as `{model-/optim-<rank>.safetensors: {name: tensor}}`."""
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    mine = split_between_ranks(list(tensors), sizes, world)[rank]
    model_part = {n: tensors[n] for n in mine if base_name(n) == n}
    optim_part = {n: tensors[n] for n in mine if base_name(n) != n}
    files = {}
    if model_part:
        files[f"model-{rank:05d}.safetensors"] = model_part
    if optim_part:
        files[f"optim-{rank:05d}.safetensors"] = optim_part
    return files


def rng_state() -> dict[str, Any]:
    """This process's torch (and CUDA) RNG states, base64 (manifest data)."""
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    # only where this process already uses CUDA: asking makes a context on GPU 0, in every rank of a CPU run
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def restore_rng(meta: dict[str, Any]) -> None:
    """Put back the torch RNG state a checkpoint recorded (nothing when it recorded none)."""
    rng = meta.get("rng", {})
    if "torch" in rng:
        try:
            torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng["torch"])), dtype=torch.uint8))
        except (RuntimeError, ValueError, TypeError) as e:  # base64 of another length, none, or no string at all
            raise CheckpointError(f"the checkpoint's rng.torch is not a torch CPU RNG state ({e})",
                                  "load another step, or one saved by moectl itself") from None


def training_meta(cfg: Config, step: int, tensors: dict[str, torch.Tensor], world: int, probe_loss: float,
                  optimizer_step: int, carried: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The manifest's `meta` of a training checkpoint after `step` steps (docs/checkpoint.md), with the `carried`
    meta of the checkpoint the run loaded (`CARRIED_META`)."""
    layout, _ = expert_layouts(cfg)
    return {
        "consumed_samples": step * cfg.train.global_batch_size,
        "config": config_to_dict(cfg),
        "expert_layout": layout,
        "glu_interleave_size": cfg.moe.glu_interleave_size,
        "recipe": recipe_meta(cfg),
        "world": {"dp": world, "ep": cfg.parallel.expert_model_parallel_size, "owners": _owners(tensors)},
        "sampler": {"seed": cfg.train.seed, "step": step, "global_batch_size": cfg.train.global_batch_size},
        "rng": rng_state(),
        "probe": probe_meta(probe_loss),
        "train_state": {"step": step, "optimizer_step": optimizer_step},
        **(carried or {}),
    }  # fmt: skip


def _owners(tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Param names per optimizer: Muon's have a momentum buffer, AdamW's (the rest with a master) do not."""
    momentum = STATE_SUFFIX["momentum_buffer"]
    muon = sorted(base_name(n) for n in tensors if n.endswith(momentum))
    adam = sorted(set(base_name(n) for n in tensors if n.endswith(STATE_SUFFIX["master"])) - set(muon))
    return {"adam": adam, "muon": muon} if muon else {"adam": adam}


# --- loading -----------------------------------------------------------------------------------------
def is_model_only(ck: Checkpoint) -> bool:
    """Whether the checkpoint holds model weights and no optimizer state at all (masters, moments)."""
    return all(base_name(n) == n for n in ck.tensor_names())


def carried_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The part of a checkpoint's meta that the checkpoints of a run from it keep (`CARRIED_META`)."""
    return {k: meta[k] for k in CARRIED_META if k in meta}


def check_architecture(saved: dict[str, Any], cfg: Config) -> None:
    """Refuse a checkpoint whose model cannot have these shapes, naming every differing key (in YAML's words).
    `num_query_groups` and `kv_channels` compare resolved (null is the heads, and hidden / heads): a config that
    writes out the value null stands for is the same model (a user trial's resume was refused over it)."""
    diffs = []
    resolved = _resolved_attention(saved.get("model", {}))
    for section, keys in ARCH_KEYS.items():
        for key in keys:
            a, b = saved.get(section, {}).get(key), getattr(getattr(cfg, section), key)
            if section == "model" and key in resolved and a != b:
                if resolved[key] == (cfg.model.kv_heads if key == "num_query_groups" else cfg.model.head_dim):
                    continue
            if a != b:
                diffs.append(f"{section}.{key}: checkpoint {fmt(a)}, config {fmt(b)}")
    if diffs:
        raise CheckpointError(
            "the checkpoint's model does not match the config: " + "; ".join(diffs),
            "load it with its own config (moectl ckpt inspect shows it), or fix these keys",
        )


def _resolved_attention(model: dict[str, Any]) -> dict[str, Any]:
    """A recorded model section's key/value heads and head dim, null resolved as the config resolves it."""
    heads, hidden = model.get("num_attention_heads"), model.get("hidden_size")
    if not isinstance(heads, int) or not isinstance(hidden, int) or heads <= 0:
        return {}
    return {"num_query_groups": model.get("num_query_groups") or heads,
            "kv_channels": model.get("kv_channels") or hidden // heads}


def read_logical(ck: Checkpoint, cfg: Config, wanted: Optional[set[str]] = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors normalised to `cfg`'s expert layout and fc1 interleave.

    `wanted` filters non-expert tensors by param name; expert tensors are always read (a rank's
    experts are sliced out after normalisation, whatever the saved layout).
    """
    names = [n for n in ck.tensor_names() if wanted is None or base_name(n) in wanted or is_expert(n)]
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
