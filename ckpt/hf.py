"""Hugging Face export and import: Mixtral and Qwen3-MoE, per-expert keys, strict both ways.

    export_hf(ckpt, dst, format)      moectl checkpoint -> dst/{config.json, model*.safetensors[, index]}
    import_hf(src, dst, config=...)   HF folder -> a committed moectl checkpoint (step 0, model weights only)

Key mapping (moectl `decoder.layers.L.` <-> HF `model.layers.L.`; M = `block_sparse_moe` for Mixtral, `mlp`
for Qwen3-MoE; gate/up/down = `w1/w3/w2` for Mixtral, `gate_proj/up_proj/down_proj` for Qwen3-MoE):

    embedding.word_embeddings.weight              model.embed_tokens.weight
    input_layernorm.weight                        input_layernorm.weight
    self_attention.linear_qkv.weight              self_attn.{q,k,v}_proj.weight (split per query group)
    self_attention.linear_proj.weight             self_attn.o_proj.weight
    self_attention.{q,k}_layernorm.weight         self_attn.{q,k}_norm.weight          (Qwen3-MoE)
    pre_mlp_layernorm.weight                      post_attention_layernorm.weight
    mlp.router.weight [E, D]                      M.gate.weight
    mlp.experts.linear_fc1.weight [E, 2F, D]      M.experts.{e}.{gate,up}.weight  (rows [gate; up])
    mlp.experts.linear_fc2.weight [E, D, F]       M.experts.{e}.{down}.weight
    mlp.linear_fc1/linear_fc2.weight (dense)      mlp.{gate,up}_proj / mlp.down_proj   (Qwen3-MoE)
    decoder.final_layernorm.weight                model.norm.weight
    output_layer.weight (absent when tied)        lm_head.weight

Both models compute what moectl computes: RMSNorm in fp32, rotate-half RoPE, GQA with query head n on kv
head n // (N/G) (Megatron's per-group qkv rows), a softmax router whose top-k is then renormalised
(always for Mixtral, `norm_topk_prob` for Qwen3), silu(gate) * up experts without biases, dropless, no
sliding window. Anything moectl cannot express exactly is refused with every difference named, never
approximated. Export writes fc1 contiguous whatever the checkpoint's `glu_interleave_size`; import
re-interleaves to the config's.

Import also reads transformers v5's fused expert tensors (`M.experts.gate_up_proj [E, 2F, D]`, rows [gate; up],
and `M.experts.down_proj [E, D, F]`, as v5 models hold them in memory), and Mixtral keys under `mlp.` (v5's
in-memory name), detected per layer by the keys present. Every tensor is checked on a dry pass first (shapes
from the file headers, meta tensors), so missing, unexpected and mis-shaped keys are all named at once.
"""

from __future__ import annotations

import json
import os
import copy
from collections import Counter
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt.convert import FilesOnDemand
from ckpt.layout import PER_EXPERT, SINGLE_GROUPED, group_expert_keys, normalize_for_model, reinterleave_fc1
from ckpt.inspect import tensor_role
from ckpt.reader import open_checkpoint
from ckpt.save import save_checkpoint
from ckpt.st_header import TORCH_NAME
from ckpt.logical import recipe_meta
from moectl.core.config import Config, config_from_dict, config_to_dict
from moectl.core.errors import CheckpointError, ConfigError

DEFAULT_SHARD_BYTES = 4 << 30
Unit = Union[str, int]  # "embed", a layer index, or "final": the pieces both directions stream through


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


def family(format: str) -> Family:
    """The family of `--format`; CheckpointError naming the supported ones otherwise."""
    if format not in FAMILIES:
        raise CheckpointError(f"unknown HF format {format!r}", f"use one of: {', '.join(FORMATS)}")
    return FAMILIES[format]


@dataclass(frozen=True)
class Dims:
    """The sizes every shape check needs, from a moectl config."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    experts: int
    ffn: int
    dense_ffn: int
    moe_layers: tuple[bool, ...]
    tied: bool
    qk_norm: bool

    @classmethod
    def of(cls, cfg: Config) -> Dims:
        m, e = cfg.model, cfg.moe
        return cls(m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_heads,
                   m.hidden_size // m.num_attention_heads, m.vocab_size, e.num_experts, e.ffn_hidden_size,
                   m.ffn_hidden_size, tuple(m.is_moe_layer(i) for i in range(m.num_layers)), m.tie_embeddings,
                   m.qk_layernorm)  # fmt: skip

    def units(self) -> list[Unit]:
        return ["embed", *range(self.layers), "final"]


class _Source:
    """Tensors read by name with their expected shape, checked against the file headers.

    `dry=True` reads nothing: it records missing and mis-shaped names and returns meta tensors of the
    expected shape (file dtype), so one pass over the mapping names every problem before any byte moves.
    """

    def __init__(self, what: str, index: dict[str, tuple[torch.dtype, list[int]]], read: Callable[[str], torch.Tensor],
                 dry: bool) -> None:  # fmt: skip
        self.what, self.index, self.read, self.dry = what, index, read, dry
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.misshaped: list[str] = []
        # a missing tensor stands in with the most common dtype, so joining it with its siblings reports
        # it as missing rather than as a dtype clash
        dtypes = Counter(dtype for dtype, _ in index.values())
        self.usual_dtype = dtypes.most_common(1)[0][0] if dtypes else torch.float32

    def has(self, name: str) -> bool:
        return name in self.index

    def get(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        self.used.add(name)
        shape = list(shape)
        if name not in self.index:
            if not self.dry:
                raise CheckpointError(f"{self.what} has no tensor {name!r}", "run the dry check first (a bug)")
            self.missing.append(name)
            return torch.empty(shape, dtype=self.usual_dtype, device="meta")
        dtype, have = self.index[name]
        if have != shape:
            self.misshaped.append(f"{name} is {have}, expected {shape}")
            if not self.dry:
                raise CheckpointError(f"{self.what}: {self.misshaped[-1]}", "the tensors do not fit the config")
            return torch.empty(shape, dtype=dtype, device="meta")
        return torch.empty(shape, dtype=dtype, device="meta") if self.dry else self.read(name)

    def raise_problems(self, fix: str) -> None:
        """After a dry pass: one error naming every missing, mis-shaped and unused tensor."""
        unused = sorted(set(self.index) - self.used)
        found = (("missing", self.missing), ("wrong shape:", self.misshaped), ("unexpected", unused))
        parts = [f"{label} {_names(xs)}" for label, xs in found if xs]
        if parts:
            raise CheckpointError(f"{self.what}: " + "; ".join(parts), fix)


def _names(xs: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(xs[:limit])
    return f"{len(xs)} tensor(s): {shown}" + (f", ... ({len(xs) - limit} more)" if len(xs) > limit else "")


def _cat(parts: Sequence[torch.Tensor], names: Sequence[str], dim: int = 0, stack: bool = False) -> torch.Tensor:
    """torch.cat/stack that refuses mixed dtypes (torch would promote silently)."""
    for t, n in zip(parts, names):
        if t.dtype != parts[0].dtype:
            raise CheckpointError(f"tensor {n!r} is {t.dtype}, but {names[0]!r} is {parts[0].dtype}",
                                  "tensors joined into one moectl tensor must share a dtype")  # fmt: skip
    return torch.stack(list(parts), dim) if stack else torch.cat(list(parts), dim)


# ---------------------------------------------------------------- architecture checks


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


def hf_config(cfg: Config, fam: Family, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for `cfg` (fields of MixtralConfig / Qwen3MoeConfig; rope in the v4 and v5 spellings)."""
    m, e = cfg.model, cfg.moe
    out: dict[str, Any] = {
        "architectures": [fam.architecture], "model_type": fam.model_type, "dtype": str(dtype).removeprefix("torch."),
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.kv_heads,
        "head_dim": m.hidden_size // m.num_attention_heads, "hidden_act": "silu",
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
    return dict(sorted(out.items()))


def moectl_fields(hf: dict[str, Any], fam: Family) -> dict[str, Any]:
    """`{"section.key": value}` of the moectl config an HF config.json fixes; refuses what moectl cannot express."""
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
    if all(isinstance(x, int) for x in (D, N, G, E, K)):
        C = D // N if D % N == 0 else None
        if C is None:
            refuse.append(f"hidden_size={D} is not a multiple of num_attention_heads={N}")
        need("head_dim", lambda v: v is None or v == C, f"moectl's head dim is hidden_size / num_attention_heads = {C}")
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
    fields: dict[str, Any] = {
        "model.num_layers": L, "model.hidden_size": D, "model.num_attention_heads": N, "model.num_query_groups": G,
        "model.vocab_size": V, "model.moe_layer_freq": moe_layers,
        "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "model.rotary_base": float(theta), "model.qk_layernorm": fam.qk_norm, "model.norm_epsilon": float(eps),
        "moe.num_experts": E, "moe.router_topk": K, "moe.ffn_hidden_size": F, "moe.router_score_function": "softmax",
        "moe.router_norm_topk_prob": norm_topk, "moe.activation": "swiglu", "moe.add_bias": False,
    }  # fmt: skip
    if moe_layers != 1:
        fields["model.ffn_hidden_size"] = hf.get("intermediate_size")
    return fields


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


# ---------------------------------------------------------------- the mapping, one unit at a time


def _experts(src: _Source, prefix: str, shape: list[int], E: int) -> torch.Tensor:
    """`[E, *shape]` from the grouped tensor or the stacked `weight{e}` ones, whichever the checkpoint has."""
    if src.has(f"{prefix}.weight") or not src.has(f"{prefix}.weight0"):
        return src.get(f"{prefix}.weight", [E, *shape])
    names = [f"{prefix}.weight{e}" for e in range(E)]
    return _cat([src.get(n, shape) for n in names], names, stack=True)


def _to_hf(src: _Source, d: Dims, fam: Family, interleave: Optional[int], unit: Unit) -> dict[str, torch.Tensor]:
    """The HF tensors of one unit, read from a moectl checkpoint."""
    D, N, G, C, V, E, F = d.hidden, d.heads, d.groups, d.head_dim, d.vocab, d.experts, d.ffn
    if unit == "embed":
        return {"model.embed_tokens.weight": src.get("embedding.word_embeddings.weight", [V, D])}
    if unit == "final":
        out = {"model.norm.weight": src.get("decoder.final_layernorm.weight", [D])}
        if not d.tied:
            out["lm_head.weight"] = src.get("output_layer.weight", [V, D])
        return out
    p, h = f"decoder.layers.{unit}.", f"model.layers.{unit}."
    qkv = src.get(p + "self_attention.linear_qkv.weight", [(N + 2 * G) * C, D]).view(G, N // G + 2, C, D)
    out = {
        h + "input_layernorm.weight": src.get(p + "input_layernorm.weight", [D]),
        h + "self_attn.q_proj.weight": qkv[:, : N // G].reshape(N * C, D),
        h + "self_attn.k_proj.weight": qkv[:, N // G].reshape(G * C, D),
        h + "self_attn.v_proj.weight": qkv[:, N // G + 1].reshape(G * C, D),
        h + "self_attn.o_proj.weight": src.get(p + "self_attention.linear_proj.weight", [D, N * C]),
        h + "post_attention_layernorm.weight": src.get(p + "pre_mlp_layernorm.weight", [D]),
    }
    if d.qk_norm:
        out[h + "self_attn.q_norm.weight"] = src.get(p + "self_attention.q_layernorm.weight", [C])
        out[h + "self_attn.k_norm.weight"] = src.get(p + "self_attention.k_layernorm.weight", [C])
    if not d.moe_layers[unit]:  # type: ignore[index]
        fc1 = src.get(p + "mlp.linear_fc1.weight", [2 * d.dense_ffn, D])
        out[h + "mlp.gate_proj.weight"] = fc1[: d.dense_ffn]
        out[h + "mlp.up_proj.weight"] = fc1[d.dense_ffn :]
        out[h + "mlp.down_proj.weight"] = src.get(p + "mlp.linear_fc2.weight", [D, d.dense_ffn])
        return out
    m = f"{h}{fam.moe_prefixes[0]}."
    out[m + "gate.weight"] = src.get(p + "mlp.router.weight", [E, D])
    fc1 = reinterleave_fc1(_experts(src, p + "mlp.experts.linear_fc1", [2 * F, D], E), interleave, None, F, dim=1)
    fc2 = _experts(src, p + "mlp.experts.linear_fc2", [D, F], E)
    gate, up, down = fam.expert_names
    for e in range(E):
        out[f"{m}experts.{e}.{gate}.weight"] = fc1[e, :F]
        out[f"{m}experts.{e}.{up}.weight"] = fc1[e, F:]
        out[f"{m}experts.{e}.{down}.weight"] = fc2[e]
    return out


def _moe_prefix(src: _Source, fam: Family, layer: int) -> str:
    found = [f"model.layers.{layer}.{p}." for p in fam.moe_prefixes if src.has(f"model.layers.{layer}.{p}.gate.weight")]
    if len(found) > 1:
        raise CheckpointError(f"{src.what}: layer {layer} has a router under both {found[0]} and {found[1]}",
                              "keep one copy of the layer's MoE block")  # fmt: skip
    return found[0] if found else f"model.layers.{layer}.{fam.moe_prefixes[0]}."


def _from_hf(src: _Source, d: Dims, fam: Family, cfg: Config, unit: Unit) -> dict[str, torch.Tensor]:
    """The moectl tensors of one unit, read from an HF model, in the config's expert layout and interleave."""
    D, N, G, C, V, E, F = d.hidden, d.heads, d.groups, d.head_dim, d.vocab, d.experts, d.ffn
    if unit == "embed":
        return {"embedding.word_embeddings.weight": src.get("model.embed_tokens.weight", [V, D])}
    if unit == "final":
        out = {"decoder.final_layernorm.weight": src.get("model.norm.weight", [D])}
        if not d.tied:
            out["output_layer.weight"] = src.get("lm_head.weight", [V, D])
        elif src.has("lm_head.weight"):  # tied models may still carry the copy: accept it only if it is one
            head, emb = src.get("lm_head.weight", [V, D]), src.get("model.embed_tokens.weight", [V, D])
            if not src.dry and not torch.equal(head.view(torch.uint8), emb.view(torch.uint8)):
                raise CheckpointError(
                    f"{src.what}: tie_word_embeddings is true but lm_head.weight differs from "
                    "model.embed_tokens.weight",
                    "set tie_word_embeddings false in config.json",
                )
        return out
    p, h = f"decoder.layers.{unit}.", f"model.layers.{unit}."
    names = [h + f"self_attn.{x}_proj.weight" for x in "qkv"]
    q, k, v = (src.get(n, [s * C, D]) for n, s in zip(names, (N, G, G)))
    parts = [q.view(G, N // G, C, D), k.view(G, 1, C, D), v.view(G, 1, C, D)]
    out = {
        p + "input_layernorm.weight": src.get(h + "input_layernorm.weight", [D]),
        p + "self_attention.linear_qkv.weight": _cat(parts, names, dim=1).reshape((N + 2 * G) * C, D),
        p + "self_attention.linear_proj.weight": src.get(h + "self_attn.o_proj.weight", [D, N * C]),
        p + "pre_mlp_layernorm.weight": src.get(h + "post_attention_layernorm.weight", [D]),
    }
    if d.qk_norm:
        out[p + "self_attention.q_layernorm.weight"] = src.get(h + "self_attn.q_norm.weight", [C])
        out[p + "self_attention.k_layernorm.weight"] = src.get(h + "self_attn.k_norm.weight", [C])
    if not d.moe_layers[unit]:  # type: ignore[index]
        gu = [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"]
        out[p + "mlp.linear_fc1.weight"] = _cat([src.get(n, [d.dense_ffn, D]) for n in gu], gu)
        out[p + "mlp.linear_fc2.weight"] = src.get(h + "mlp.down_proj.weight", [D, d.dense_ffn])
        return out
    m = _moe_prefix(src, fam, unit)  # type: ignore[arg-type]
    moe = {p + "mlp.router.weight": src.get(m + "gate.weight", [E, D])}
    if src.has(m + "experts.gate_up_proj") or src.has(m + "experts.down_proj"):  # transformers v5 fused
        fc1 = src.get(m + "experts.gate_up_proj", [E, 2 * F, D])
        fc2 = src.get(m + "experts.down_proj", [E, D, F])
    else:
        gate, up, down = fam.expert_names
        rows = []
        for e in range(E):
            gu = [f"{m}experts.{e}.{gate}.weight", f"{m}experts.{e}.{up}.weight"]
            rows.append(_cat([src.get(n, [F, D]) for n in gu], gu))
        names_e = [f"{m}experts.{e}.{gate}.weight" for e in range(E)]
        fc1 = _cat(rows, names_e, stack=True)
        downs = [f"{m}experts.{e}.{down}.weight" for e in range(E)]
        fc2 = _cat([src.get(n, [D, F]) for n in downs], downs, stack=True)
    moe[p + "mlp.experts.linear_fc1.weight"] = fc1
    moe[p + "mlp.experts.linear_fc2.weight"] = fc2
    layout: Any = SINGLE_GROUPED if cfg.moe.single_grouped_weight else PER_EXPERT
    moe = normalize_for_model(moe, num_experts=E, target_layout=layout, source_interleave=None,
                              target_interleave=cfg.moe.glu_interleave_size, ffn_size=F)  # fmt: skip
    out.update(moe)
    return out


# ---------------------------------------------------------------- export


def export_hf(
    ckpt_path: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    format: str = "mixtral",
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write the checkpoint's model weights as an HF `format` model folder `dst` (which must not exist).

    The weights are exported in their stored dtype (fp32 masters are not used); `from_pretrained(dst)`
    loads them. Refuses, naming each setting, a model the format cannot express exactly.
    """
    fam = family(format)
    dst = _new_path(Path(dst))
    with open_checkpoint(ckpt_path) as ck:
        cfg = _checkpoint_config(ck.meta, ck.path)
        why = unexportable(cfg, fam)
        if why:
            raise CheckpointError(
                f"cannot export {ck.path} as {fam.format}: " + "; ".join(why),
                f"{fam.format} cannot express these: train with each listed key set as {fam.format} has it, "
                "or export another format",
            )
        d = Dims.of(cfg)
        index = {n: (getattr(torch, r["dtype"]), r["shape"]) for n, r in ck.manifest["tensors"].items()
                 if tensor_role(n) == "model"}  # fmt: skip
        group_expert_keys(index, d.experts)
        interleave = ck.meta["glu_interleave_size"]
        dry = _Source(str(ck.path), index, ck.read, dry=True)
        for u in d.units():
            _to_hf(dry, d, fam, interleave, u)
        dry.raise_problems(f"the checkpoint does not match its own config as a {fam.format} model")
        src = _Source(str(ck.path), index, ck.read, dry=False)
        tmp = dst.parent / f".{dst.name}.tmp-{secrets.token_hex(4)}"
        tmp.mkdir(parents=True)
        try:
            writer = _ShardWriter(tmp, max_shard_bytes)
            for u in d.units():
                writer.add(_to_hf(src, d, fam, interleave, u))
            writer.close()
            dtype = index["embedding.word_embeddings.weight"][0]
            (tmp / "config.json").write_text(json.dumps(hf_config(cfg, fam, dtype), indent=2) + "\n")
            os.rename(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dst


class _ShardWriter:
    """HF-style shards: `model.safetensors`, or `model-0000k-of-0000n.safetensors` + index.json past the limit."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder, self.max_bytes = folder, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        # own, contiguous storage: safetensors refuses views that share memory
        self.pending.update({n: t.contiguous().clone() for n, t in tensors.items()})
        self.pending_bytes += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        save_file(self.pending, str(self.folder / f"shard-{len(self.shards)}.tmp"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        for k, name in enumerate(names):
            os.rename(self.folder / f"shard-{k}.tmp", self.folder / name)
        if n > 1:
            weight_map = {t: names[k] for k, shard in enumerate(self.shards) for t in shard}
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---------------------------------------------------------------- import


def import_hf(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    base: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Import the HF Mixtral / Qwen3-MoE folder `src` as a committed moectl checkpoint under `dst` (new).

    The architecture comes from `src/config.json`; training settings, the expert layout
    (`moe.single_grouped_weight`) and `moe.glu_interleave_size` from `base` (the user's config as plain
    data, `--set` overrides applied), which may not contradict the architecture. Writes step 0 with model weights only, in their HF dtype
    (no optimizer state: train from it with `checkpoint.no_load_optim=true`, which takes the fp32 masters
    from these weights; no probe loss is recorded). Returns the step folder.
    """
    src = Path(src).expanduser()
    hf = _read_json(src / "config.json")
    fam = next((f for f in FAMILIES.values() if f.model_type == hf.get("model_type")), None)
    if fam is None:
        raise CheckpointError(f"{src / 'config.json'}: model_type {hf.get('model_type')!r} is not supported",
                              f"import-hf reads {', '.join(f.model_type for f in FAMILIES.values())}")  # fmt: skip
    cfg = _import_config(base, moectl_fields(hf, fam))
    root = _new_path(Path(dst))
    d = Dims.of(cfg)
    index, read = _hf_index(src)
    dry = _Source(str(src), index, read, dry=True)
    sizes = {u: sum(t.numel() * t.element_size() for t in _from_hf(dry, d, fam, cfg, u).values()) for u in d.units()}
    dry.raise_problems(f"the weights do not match {src / 'config.json'}")
    real = _Source(str(src), index, read, dry=False)

    def build(units: list[Unit]) -> dict[str, torch.Tensor]:
        return {n: t for u in units for n, t in _from_hf(real, d, fam, cfg, u).items()}

    plan = _plan_shards(sizes, max_shard_bytes)
    resolved = config_to_dict(cfg)
    meta = {
        "consumed_samples": 0, "config": resolved,
        "expert_layout": SINGLE_GROUPED if cfg.moe.single_grouped_weight else PER_EXPERT,
        "glu_interleave_size": cfg.moe.glu_interleave_size, "recipe": recipe_meta(cfg),
        "world": {"dp": 1, "ep": 1, "owners": {}}, "sampler": {}, "rng": {}, "probe": {},
    }  # fmt: skip
    try:
        return save_checkpoint(root, 0, FilesOnDemand(plan, build), meta)  # type: ignore[arg-type]
    except BaseException:
        if root.is_dir() and not any(root.iterdir()):
            root.rmdir()
        raise


def _plan_shards(sizes: dict[Unit, int], max_bytes: int) -> dict[str, list[Unit]]:
    """Whole units into `model-NNNNN.safetensors` files of at most `max_bytes` (one unit may exceed it)."""
    plan: dict[str, list[Unit]] = {}
    current: list[Unit] = []
    used = 0
    for u, n in sizes.items():
        if current and used + n > max_bytes:
            plan[f"model-{len(plan):05d}.safetensors"] = current
            current, used = [], 0
        current.append(u)
        used += n
    plan[f"model-{len(plan):05d}.safetensors"] = current
    return plan


def _import_config(base: dict[str, Any] | None, fields: dict[str, Any]) -> Config:
    """The user's config with the HF architecture fields; a contradiction is an error naming the key."""
    raw = copy.deepcopy(base or {})
    clash = []
    for dotted, value in fields.items():
        section, key = dotted.split(".")
        sec = raw.get(section) or {}
        if not isinstance(sec, dict):
            continue  # config_from_dict names it
        if key in sec and sec[key] != value:
            clash.append(f"{dotted}={sec[key]!r} (the HF model has {value!r})")
        raw[section] = {**sec, key: value}
    if clash:
        raise CheckpointError(
            "the config contradicts the HF model: " + "; ".join(clash),
            "drop those keys from --config/--set: import-hf takes the architecture from config.json",
        )
    return config_from_dict(raw)


def _hf_index(src: Path) -> tuple[dict[str, tuple[torch.dtype, list[int]]], Callable[[str], torch.Tensor]]:
    """Every tensor of the HF folder (name -> dtype, shape) from the safetensors headers, and a reader."""
    index_file = src / "model.safetensors.index.json"
    weight_map = _read_json(index_file).get("weight_map", {}) if index_file.is_file() else None
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in src.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in src.iterdir() if p.suffix in (".bin", ".pt", ".pth")) if src.is_dir() else []
        hint = f" ({', '.join(pickled)} are pickles: never loaded)" if pickled else ""
        raise CheckpointError(
            f"{src} holds no *.safetensors weights{hint}",
            "convert the model to safetensors first (transformers' save_pretrained writes them)",
        )
    handles, index, where = {}, {}, {}
    for f in files:
        try:
            handles[f] = h = safe_open(str(src / f), framework="pt", device="cpu")
        except Exception as e:
            raise CheckpointError(f"{src / f}: not a readable safetensors file ({e})",
                                  "re-download or re-save it") from None  # fmt: skip
        for name in h.keys():
            if name in where:
                raise CheckpointError(f"{src}: tensor {name!r} is in both {where[name]} and {f}", "keep one copy")
            view = h.get_slice(name)
            dtype = TORCH_NAME.get(view.get_dtype())
            if dtype is None:
                raise CheckpointError(f"{src / f}: tensor {name!r} has unsupported dtype {view.get_dtype()}",
                                      "convert it to a float dtype first")  # fmt: skip
            where[name], index[name] = f, (getattr(torch, dtype), list(view.get_shape()))
    if weight_map is not None and set(weight_map) != set(where):
        off = sorted(set(weight_map) ^ set(where))
        raise CheckpointError(f"{index_file}: weight_map and the shard files disagree on {_names(off)}",
                              "regenerate the index (save_pretrained) or fix the shards")  # fmt: skip
    return index, lambda name: handles[where[name]].get_tensor(name)


# ---------------------------------------------------------------- small helpers


def _checkpoint_config(meta: dict[str, Any], path: Path) -> Config:
    try:
        return config_from_dict(meta["config"])
    except ConfigError as e:
        raise CheckpointError(f"{path}: its recorded config is not valid for this moectl: {e.message}",
                              "export with the moectl version that wrote the checkpoint") from None  # fmt: skip


def _read_json(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found", "give an HF model folder (config.json + *.safetensors)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read as JSON ({e})", "fix or re-download the file") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object", "fix or re-download the file")
    return obj


def _new_path(p: Path) -> Path:
    p = p.expanduser()
    if p.exists() or p.is_symlink():
        raise CheckpointError(f"destination {p} already exists", "give a new folder: nothing is ever overwritten")
    return p
