"""Hugging Face export and import: Mixtral and Qwen3-MoE, per-expert keys, strict both ways.

    export_hf(ckpt, dst, format)      moectl checkpoint -> dst/{config.json, generation_config.json,
                                      model*.safetensors[, index]}
    import_hf(src, dst, base=...)     HF folder -> a committed moectl checkpoint (step 0, model weights only)
                                      and dst/config.yaml, the moectl config to train it with

config.json <-> moectl config (which fields moectl owns, what an import records so export writes it back)
is `ckpt/hf_config.py`; this module maps the tensors. The attention head dim is `model.kv_channels`
(HF's `head_dim`), which need not be hidden / heads.

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
import math
import os
from collections import Counter
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt.cleanup import undo_new_root
from ckpt.convert import FilesOnDemand
from ckpt.destination import new_destination, raise_write_failure
from ckpt.discovery import TOOL_ADVICE, resolve_load_path
from ckpt.layout import PER_EXPERT, SINGLE_GROUPED, group_expert_keys, normalize_for_model, reinterleave_fc1
from ckpt.inspect import tensor_role
from ckpt.reader import open_checkpoint
from ckpt.save import save_checkpoint
from ckpt.st_header import TORCH_NAME
from ckpt.hf_config import (
    FAMILIES, FORMATS, Family, family, family_of, generation_config, hf_config, moectl_config, origin_meta,
    unexportable,
)  # fmt: skip
from ckpt.logical import probe_meta, recipe_meta
from moectl.core.config import Config, config_from_dict, config_to_dict, dump_config
from moectl.core.errors import CheckpointArgumentError, CheckpointError, ConfigError, MoectlError

__all__ = ["FAMILIES", "FORMATS", "Family", "export_hf", "family", "import_hf"]

DEFAULT_SHARD_BYTES = 4 << 30
Unit = Union[str, int]  # "embed", a layer index, or "final": the pieces both directions stream through


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
                   m.head_dim, m.vocab_size, e.num_experts, e.ffn_hidden_size,
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
    dst = new_destination(Path(dst), source=resolve_load_path(ckpt_path, TOOL_ADVICE))  # before hashing the source
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
        try:
            tmp.mkdir(parents=True)
            writer = _ShardWriter(tmp, max_shard_bytes)
            for u in d.units():
                writer.add(_to_hf(src, d, fam, interleave, u))
            writer.close()
            dtype = index["embedding.word_embeddings.weight"][0]
            written = hf_config(cfg, fam, dtype, ck.meta.get("hf"))
            (tmp / "config.json").write_text(json.dumps(written, indent=2) + "\n")
            generation = generation_config(written, ck.meta.get("hf"))
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
            os.rename(tmp, dst)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise_write_failure("the export", dst, e)  # the OS refused a write: one line
            raise
    return dst


def _default_file_mode() -> int:
    """What `open()` would give a new file here: 0666 less the process's umask (read, then put back)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


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
        mode = _default_file_mode()
        for k, name in enumerate(names):
            os.chmod(self.folder / f"shard-{k}.tmp", mode)  # safetensors writes 0600; the export is to share
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
    probe: Optional[Callable[[Config, dict[str, torch.Tensor]], float]] = None,
    check_config: Optional[Callable[[Config], None]] = None,
) -> Path:
    """Import the HF Mixtral / Qwen3-MoE folder `src` as a committed moectl checkpoint under `dst` (new).

    The architecture comes from `src/config.json` (no moectl config needed); training settings, the expert
    layout (`moe.single_grouped_weight`) and `moe.glu_interleave_size` from `base` (the user's config as
    plain data, `--set` overrides applied), which may not contradict the architecture. Writes step 0 with
    model weights only, in their HF dtype (no optimizer state: training from it takes the fp32 masters from
    these weights and starts fresh moments), records config.json and generation_config.json in the manifest (`meta["hf"]`, so export
    writes them back), and writes `dst/config.yaml`: the resolved moectl config, with `checkpoint.load` at
    `dst`, to train or validate with. `probe(cfg, tensors)`, when given (the CLI passes the engine's), is the
    probe loss of a model holding these weights; it is recorded for `ckpt validate`. `check_config(cfg)`, when
    given (the CLI passes the rules `train` enforces), raises before anything is written if the resolved
    config could not train. Returns the step folder.
    """
    src = Path(src).expanduser()
    hf = _read_json(src / "config.json")
    fam = family_of(hf, str(src / "config.json"))
    root = new_destination(Path(dst))
    cfg = moectl_config(hf, fam, base, _run_keys(root))
    if check_config is not None:  # a config.yaml that `moectl train` refuses would be written otherwise
        check_config(cfg)
    gen_file = src / "generation_config.json"
    generation = _read_json(gen_file) if gen_file.is_file() else None
    d = Dims.of(cfg)
    index, read = _hf_index(src)
    dry = _Source(str(src), index, read, dry=True)
    sizes = {u: sum(t.numel() * t.element_size() for t in _from_hf(dry, d, fam, cfg, u).values()) for u in d.units()}
    dry.raise_problems(f"the weights do not match {src / 'config.json'}")
    real = _Source(str(src), index, read, dry=False)

    def build(units: list[Unit]) -> dict[str, torch.Tensor]:
        return {n: t for u in units for n, t in _from_hf(real, d, fam, cfg, u).items()}

    plan = _plan_shards(sizes, max_shard_bytes)
    meta = {
        "consumed_samples": 0, "config": config_to_dict(cfg),
        "expert_layout": SINGLE_GROUPED if cfg.moe.single_grouped_weight else PER_EXPERT,
        "glu_interleave_size": cfg.moe.glu_interleave_size, "recipe": recipe_meta(cfg),
        "world": {"dp": 1, "ep": 1, "owners": {}}, "sampler": {}, "rng": {},
        "probe": _probe(probe, cfg, lambda: build(d.units())),
        "hf": origin_meta(fam, hf, generation),
    }  # fmt: skip
    try:
        step = save_checkpoint(root, 0, FilesOnDemand(plan, build), meta)  # type: ignore[arg-type]
    except BaseException as e:
        undo_new_root(root)
        raise_write_failure("the imported checkpoint", root, e)  # the OS refused a write: one line
        raise
    (root / "config.yaml").write_text(dump_config(cfg))
    return step


def _probe(probe: Optional[Callable[[Config, dict[str, torch.Tensor]], float]], cfg: Config,
           weights: Callable[[], dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The manifest's probe for the imported weights, or {} without a probe function."""
    if probe is None:
        return {}
    try:
        loss = probe(cfg, weights())
    except MoectlError as e:  # e.g. the run's data cannot be read here
        raise CheckpointError(f"the probe loss for ckpt validate needs a model on the run's data: {e.message}",
                              f"{e.fix or 'fix the config'}; or import with --no-probe") from None  # fmt: skip
    if not math.isfinite(loss):  # the manifest could not hold it, and a run from these weights would not train
        tensors = weights()
        bad = sorted(n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))
        more = " ..." if len(bad) > 3 else ""
        where = f"non-finite values in {', '.join(bad[:3])}{more}" if bad else "no non-finite weight"
        raise CheckpointError(f"the imported weights give a probe loss of {loss} ({where})",
                              "check the source model's weights, or import with --no-probe; nothing was imported")
    return probe_meta(loss)


def _run_keys(root: Path) -> dict[str, Any]:
    """Where a run from the import trains and what it loads (unless the user's config says otherwise).

    `runs/x/checkpoints` is a run's own checkpoints folder, so the run is `runs/x`; any other folder gets
    a sibling `<name>-run`. Absolute paths, so the written config works from any directory.
    """
    where = root.resolve()
    run = where.parent if where.name == "checkpoints" else where.parent / f"{where.name}-run"
    return {"run_dir": str(run), "checkpoint.load": str(where)}


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
            _require_readable(src / f)  # an OS refusal says so; else the file opens and is no safetensors
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


def _require_readable(path: Path) -> None:
    """A `CheckpointError` naming the OS's reason (errno's text) unless `path` opens for reading.

    safetensors reports every failure to open a file as a FileNotFoundError "No such file or directory" (no
    errno), so a model file this user may not read was said to be missing; opening it here, once safe_open has
    failed, gets the truth.
    """
    try:
        with open(path, "rb"):
            pass
    except PermissionError as e:  # the model may be fine: the command named what this user cannot read (exit 2)
        raise CheckpointArgumentError(
            f"{path}: cannot be read ({e.strerror or e})",
            "make it readable by this user (chmod a+r, and a+x on its folders), or import a readable copy",
        ) from None
    except OSError as e:  # a shard the index lists but the folder lacks, an I/O error: the model is incomplete
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})", "re-download or re-save it") from None


def _checkpoint_config(meta: dict[str, Any], path: Path) -> Config:
    try:
        return config_from_dict(meta["config"])
    except ConfigError as e:
        what = "; ".join(x.message for x in getattr(e, "errors", [e]))  # without their fixes: this one has its own
        raise CheckpointError(f"{path}: its recorded config is not valid for this moectl: {what}",
                              "export with the moectl version that wrote the checkpoint") from None  # fmt: skip


def _what_it_is(src: Path) -> str:
    """Why `src` has no config.json, where it can be told: a file, or a moectl checkpoint (which needs no import)."""
    if src.is_file():
        return f": {src} is a file, not a model folder"
    if (src / "manifest.json").is_file() or (src / "latest").is_file():
        return f": {src} is a moectl checkpoint, which train and the ckpt commands load as it is (no import)"
    return ""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):  # the source named nothing usable: the command's fault (exit 2)
        raise CheckpointArgumentError(f"{path} not found{_what_it_is(path.parent)}",
                                      "give an HF model folder (config.json + *.safetensors)") from None  # fmt: skip
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read as JSON ({e})", "fix or re-download the file") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object", "fix or re-download the file")
    return obj
