"""HF `config.json` <-> moectl config: the two families, what each can express, and what export keeps.

    moectl_config(hf, fam, base)       config.json (+ the user's config) -> the moectl config of the import
    moectl_fields(hf, fam)             config.json -> the moectl keys it fixes, and the defaults it suggests
    hf_config(cfg, fam, dtype, origin) moectl config -> config.json (keeping what the import read)
    generation_config(config)          generation_config.json beside it
    origin_meta(fam, hf, generation)   what import-hf records in the checkpoint (`meta["hf"]`)

Import reads every architecture field into moectl keys (`head_dim` into `model.kv_channels`, refusing what
moectl cannot compute exactly) and records the whole config.json and generation_config.json in the
checkpoint's manifest (`meta["hf"]`, carried through training and convert). Export derives every field
moectl owns from the checkpoint's config (`OWNED`) and takes every other field from that record when it
is of the same family: token ids, `router_aux_loss_coef` (moectl's aux loss is normalised differently, so
its own coefficient is not HF's), `initializer_range`, `max_position_embeddings`, `rope_scaling`,
`transformers_version`, ... So an imported model exports with the config.json it came with, the
architecture re-derived; a model trained from scratch gets moectl's values and null token ids.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from moectl.core.config import Config, config_from_dict
from moectl.core.errors import CheckpointArgumentError, CheckpointError


@dataclass(frozen=True)
class Family:
    """One HF architecture: its names and the few ways its keys differ."""

    format: str  # the CLI's --format
    model_type: str
    architecture: str
    moe_prefixes: tuple[str, ...]  # accepted on import; the first is written on export
    expert_names: tuple[str, str, str]  # gate, up, down
    qk_norm: bool
    default_theta: float  # rope_theta when config.json names none (transformers' default for the class)


FAMILIES = {
    "mixtral": Family("mixtral", "mixtral", "MixtralForCausalLM", ("block_sparse_moe", "mlp"),
                      ("w1", "w3", "w2"), False, 1e6),
    "qwen3-moe": Family("qwen3-moe", "qwen3_moe", "Qwen3MoeForCausalLM", ("mlp",),
                        ("gate_proj", "up_proj", "down_proj"), True, 1e4),  # fmt: skip
}
FORMATS = tuple(FAMILIES)

#: config.json fields export always derives from the moectl config (the architecture and its numerics).
OWNED = frozenset({
    "architectures", "model_type", "dtype", "torch_dtype", "vocab_size", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
    "rope_parameters", "tie_word_embeddings", "num_experts_per_tok", "intermediate_size", "moe_intermediate_size",
    "num_experts", "num_local_experts", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
    "sliding_window", "use_sliding_window", "attention_bias", "attention_dropout", "router_jitter_noise",
})  # fmt: skip
#: Fields worth keeping when an import of one family is exported as the other.
NEUTRAL = ("bos_token_id", "eos_token_id", "pad_token_id", "router_aux_loss_coef", "initializer_range",
           "max_position_embeddings")  # fmt: skip
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def family(format: str) -> Family:
    """The family of `--format`; CheckpointError naming the supported ones otherwise."""
    if format not in FAMILIES:
        raise CheckpointError(f"unknown HF format {format!r}", f"use one of: {', '.join(FORMATS)}")
    return FAMILIES[format]


def family_of(hf: dict[str, Any], where: str) -> Family:
    """The family of a config.json by its `model_type`; CheckpointError naming the supported ones otherwise."""
    fam = next((f for f in FAMILIES.values() if f.model_type == hf.get("model_type")), None)
    if fam is None:
        raise CheckpointError(f"{where}: model_type {hf.get('model_type')!r} is not supported",
                              f"import-hf reads {', '.join(f.model_type for f in FAMILIES.values())}")  # fmt: skip
    return fam


def origin_meta(fam: Family, hf: dict[str, Any], generation: Optional[dict[str, Any]]) -> dict[str, Any]:
    """`meta["hf"]` of an imported checkpoint: the family and the files its config came from, verbatim."""
    return {"format": fam.format, "config": hf, "generation_config": generation}


# ---------------------------------------------------------------- export


def unexportable(cfg: Config, fam: Family) -> list[str]:
    """Every setting of `cfg` that `fam` cannot express exactly (empty: exportable)."""
    m, e = cfg.model, cfg.moe
    name = fam.architecture.removesuffix("ForCausalLM")
    out = []
    if e.router_score_function != "softmax":
        out.append(f"moe.router_score_function={e.router_score_function} ({name} routes with softmax)")
    if e.activation != "swiglu":
        out.append(f"moe.activation={e.activation} ({name} experts compute silu(gate) * up)")
    if e.add_bias:
        out.append(f"moe.add_bias=true ({name} experts have no biases)")
    if e.capacity_factor is not None:
        out.append(f"moe.capacity_factor={e.capacity_factor} ({name} is dropless)")
    if fam.format == "mixtral" and not e.router_norm_topk_prob:
        out.append("moe.router_norm_topk_prob=false (Mixtral always renormalises the top-k probabilities)")
    dense = [i for i in range(m.num_layers) if not m.is_moe_layer(i)]
    if fam.format == "mixtral" and dense:
        out.append(f"model.moe_layer_freq={m.moe_layer_freq} makes layers {dense} dense (every Mixtral layer is MoE)")
    if m.qk_layernorm != fam.qk_norm:
        has = "always has" if fam.qk_norm else "has no"
        out.append(f"model.qk_layernorm={str(m.qk_layernorm).lower()} ({name} {has} q_norm/k_norm)")
    return out


def _derived(cfg: Config, fam: Family, dtype: torch.dtype) -> dict[str, Any]:
    """config.json as the moectl config alone gives it (fields of MixtralConfig / Qwen3MoeConfig)."""
    m, e = cfg.model, cfg.moe
    out: dict[str, Any] = {
        "architectures": [fam.architecture], "model_type": fam.model_type, "dtype": str(dtype).removeprefix("torch."),
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim, "hidden_act": "silu",
        "max_position_embeddings": m.seq_length, "rms_norm_eps": m.norm_epsilon,
        "rope_theta": m.rotary_base, "rope_parameters": {"rope_type": "default", "rope_theta": m.rotary_base},
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_method_std,
        "num_experts_per_tok": e.router_topk, "output_router_logits": False,
        # training-time only; moectl's aux loss is normalised per routing, HF's per token and over layers
        "router_aux_loss_coef": e.aux_loss_coeff,
        "attention_dropout": 0.0, "sliding_window": None, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }  # fmt: skip
    if fam.format == "mixtral":
        out.update(intermediate_size=e.ffn_hidden_size, num_local_experts=e.num_experts, router_jitter_noise=0.0)
    else:
        out.update(intermediate_size=m.ffn_hidden_size, moe_intermediate_size=e.ffn_hidden_size,
                   num_experts=e.num_experts, norm_topk_prob=e.router_norm_topk_prob, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(m.num_layers) if not m.is_moe_layer(i)],
                   use_sliding_window=False, attention_bias=False)  # fmt: skip
    return out


def hf_config(cfg: Config, fam: Family, dtype: torch.dtype, origin: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """config.json for `cfg`: the `OWNED` fields derived from it, the rest from `origin` (`meta["hf"]`) if any.

    rope is written in both spellings (v4 `rope_theta`, v5 `rope_parameters`); a v4 `torch_dtype` the
    origin had is kept in step with `dtype`.
    """
    out = _derived(cfg, fam, dtype)
    read = (origin or {}).get("config") or {}
    same_family = (origin or {}).get("format") == fam.format
    for key, value in read.items():
        # an owned field the family does not write (Qwen3's alias num_local_experts) is kept as read
        if (key not in OWNED or key not in out) and (same_family or key in NEUTRAL):
            out[key] = value
    if "torch_dtype" in read and same_family:
        out["torch_dtype"] = out["dtype"]
    if same_family and "head_dim" in read and read["head_dim"] is None and cfg.model.kv_channels is None:
        out["head_dim"] = None  # v5 Mixtral writes null for hidden / heads: keep its spelling
    return dict(sorted(out.items()))


def generation_config(config: dict[str, Any], origin: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """generation_config.json: the imported one when there was one, else what transformers derives from the
    model config (`GenerationConfig.from_model_config`: its token ids); token ids follow `config` either way."""
    read = (origin or {}).get("generation_config")
    out: dict[str, Any] = dict(read) if isinstance(read, dict) else {"_from_model_config": True}
    for key in TOKEN_IDS:
        if config.get(key) is not None and (key not in out or not isinstance(read, dict)):
            out[key] = config[key]
    return dict(sorted(out.items()))


# ---------------------------------------------------------------- import


def moectl_fields(hf: dict[str, Any], fam: Family) -> tuple[dict[str, Any], dict[str, Any]]:
    """`({"section.key": value} the HF config fixes, {"section.key": value} it suggests)`.

    The first may not be contradicted by the user's config; the second fills keys the user left unset
    (`model.init_method_std` from `initializer_range`, Qwen3's dense `intermediate_size` when no layer is
    dense). Refuses, naming every field, what moectl cannot express.
    """
    refuse: list[str] = []

    def need(key: str, ok: Callable[[Any], bool], why: str, default: Any = None) -> Any:
        v = hf.get(key, default)
        if not ok(v):
            refuse.append(f"{key}={json.dumps(v)} ({why})")
        return v

    def num(key: str, default: Any = None) -> Any:
        def ok(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0

        return need(key, ok, "must be a positive number", default)

    L, D, N = num("num_hidden_layers"), num("hidden_size"), num("num_attention_heads")
    G = num("num_key_value_heads", N)
    E = num("num_local_experts" if fam.format == "mixtral" else "num_experts", hf.get("num_local_experts"))
    K, V = num("num_experts_per_tok"), num("vocab_size")
    F = num("intermediate_size" if fam.format == "mixtral" else "moe_intermediate_size")
    eps = num("rms_norm_eps")
    need("hidden_act", lambda v: v == "silu", "moectl experts are swiglu: silu(gate) * up", "silu")
    need("attention_dropout", lambda v: not v, "moectl has no attention dropout", 0.0)
    need("quantization_config", lambda v: v is None, "quantized checkpoints are not imported; dequantize first")
    kv_channels = None
    if all(isinstance(x, int) for x in (D, N, G, E, K)):
        C = hf.get("head_dim")
        if C is None and D % N:
            refuse.append(f"hidden_size={D} is not a multiple of num_attention_heads={N} and head_dim is not given")
        elif C is not None and not (isinstance(C, int) and not isinstance(C, bool) and C > 0 and C % 2 == 0):
            refuse.append(f"head_dim={json.dumps(C)} (must be a positive even int: RoPE rotates channel pairs)")
        elif C is not None and C * N != D:
            kv_channels = C  # Qwen3-30B-A3B: 2048 hidden, 32 heads of 128
        if N % G:
            refuse.append(f"num_key_value_heads={G} does not divide num_attention_heads={N}")
        if K > E:
            refuse.append(f"num_experts_per_tok={K} exceeds the {E} experts")
    theta = _rope_theta(hf, fam, refuse)
    if fam.format == "mixtral":
        need("sliding_window", lambda v: v is None, "moectl attends over the whole sequence")
        need("router_jitter_noise", lambda v: not v, "moectl's router has no jitter", 0.0)
        moe_layers: Any = 1
        norm_topk = True
    else:
        need("use_sliding_window", lambda v: not v, "moectl attends over the whole sequence", False)
        need("attention_bias", lambda v: not v, "moectl's attention has no biases", False)
        step = need("decoder_sparse_step", lambda v: isinstance(v, int) and v >= 1, "must be a positive int", 1)
        only = need("mlp_only_layers", lambda v: isinstance(v, list), "must be a list of layer indices", []) or []
        # Qwen3MoeDecoderLayer: MoE unless listed in mlp_only_layers, and only every decoder_sparse_step-th layer
        valid = isinstance(L, int) and isinstance(step, int)
        flags = [int(i not in only and (i + 1) % step == 0) for i in range(L)] if valid else []
        moe_layers = 1 if all(flags) else flags
        norm_topk = need("norm_topk_prob", lambda v: isinstance(v, bool), "must be true or false", False)
    if refuse:
        raise CheckpointError(
            f"cannot import this {fam.model_type} model exactly: " + "; ".join(refuse),
            "moectl imports only what it computes exactly the same way; adapt the model first",
        )
    fixed: dict[str, Any] = {
        "model.num_layers": L, "model.hidden_size": D, "model.num_attention_heads": N, "model.num_query_groups": G,
        "model.kv_channels": kv_channels, "model.vocab_size": V, "model.moe_layer_freq": moe_layers,
        "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "model.rotary_base": float(theta), "model.qk_layernorm": fam.qk_norm, "model.norm_epsilon": float(eps),
        "moe.num_experts": E, "moe.router_topk": K, "moe.ffn_hidden_size": F, "moe.router_score_function": "softmax",
        "moe.router_norm_topk_prob": norm_topk, "moe.activation": "swiglu", "moe.add_bias": False,
    }  # fmt: skip
    suggested: dict[str, Any] = {}
    dense = hf.get("intermediate_size") if fam.format == "qwen3-moe" else None
    if moe_layers != 1:
        fixed["model.ffn_hidden_size"] = dense
    elif isinstance(dense, int) and dense > 0:
        suggested["model.ffn_hidden_size"] = dense  # unused by an all-MoE model; exported back as read
    init = hf.get("initializer_range")
    if isinstance(init, (int, float)) and not isinstance(init, bool) and init > 0:
        suggested["model.init_method_std"] = float(init)
    return fixed, suggested


def moectl_config(hf: dict[str, Any], fam: Family, base: Optional[dict[str, Any]] = None,
                  defaults: Optional[dict[str, Any]] = None) -> Config:
    """The moectl config of an import: the user's `base` (plain data, `--set` applied) with the fields
    config.json fixes (a contradiction is a CheckpointArgumentError naming every key: the user's config is
    wrong, not the model) and, where the user set nothing, the ones it suggests and `defaults`
    (`{"section.key" or top-level key: value}`)."""
    fixed, suggested = moectl_fields(hf, fam)
    if isinstance(fixed["model.vocab_size"], int) and fixed["model.vocab_size"] < 256:
        suggested["data.source"] = "synthetic"  # the default corpus feeds bytes (ids to 255): it would not fit
    raw = copy.deepcopy(base or {})
    clash: dict[str, str] = {}  # dotted key -> the user's value and config.json's
    for dotted, value in {**suggested, **(defaults or {}), **fixed}.items():
        section, key = dotted.split(".") if "." in dotted else ("", dotted)
        sec = (raw.get(section) or {}) if section else raw
        if not isinstance(sec, dict):
            continue  # config_from_dict names it
        if key in sec and dotted not in fixed:
            continue  # the user's choice wins over a suggestion
        if key in sec and sec[key] != value:
            clash[dotted] = f"{dotted}={sec[key]!r} (the HF model has {value!r})"
        if section:
            raw[section] = {**sec, key: value}
        else:
            raw[key] = value
    if clash:  # the user's --set/--config, not the model, is wrong: usage (exit 2), as validate's --set is
        raise CheckpointArgumentError(
            "the config contradicts the HF model: " + "; ".join(clash.values()),
            f"drop {' and '.join(clash)} from --set/--config (import-hf takes the architecture from config.json "
            "and needs no --config)",
        )
    return config_from_dict(raw)


def _rope_theta(hf: dict[str, Any], fam: Family, refuse: list[str]) -> float:
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        refuse.append(f"rope_parameters={json.dumps(rp)} (expected an object)")
        return fam.default_theta
    extra = sorted(set(rp) - {"rope_type", "type", "rope_theta"})
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind != "default" or extra:
        got = json.dumps(rp, sort_keys=True)
        refuse.append(f"rope_parameters={got} (moectl has plain RoPE only: rope_type default, rope_theta)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        refuse.append(f"partial_rotary_factor={hf['partial_rotary_factor']} (moectl rotates the whole head)")
    return float(rp.get("rope_theta", hf.get("rope_theta", fam.default_theta)))
