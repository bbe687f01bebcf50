"""Does a checkpoint's recorded config describe its tensors? A cheap check over the manifest alone.

The manifest's digest (ckpt/seal.py) catches an edit, not a tool or a hand that re-seals it: a config whose
`model.hidden_size` says 128 beside 64-wide tensors passed `ckpt validate`'s integrity stage, `ckpt convert`
copied the contradiction into a new checkpoint, and a resume failed deep in the optimizer with a traceback.
Every dimension below is read off the manifest's recorded shapes, so no tensor is read: `ckpt.manifest.check`
runs it wherever a manifest is loaded (verify, open, convert, resume).

Only the dimensions the config fixes unambiguously are checked (the embedding, head, router and expert
tensors against `model.hidden_size`, `model.vocab_size`, `model.ffn_hidden_size`, `moe.num_experts`,
`moe.ffn_hidden_size`, and the layer indices against `model.num_layers`); a key the config does not record
as an int, or a tensor it does not hold, is not checked. What is left (attention head counts) is caught where
the tensors meet the model's params (trainer/checkpointing/resume.py).
"""

from __future__ import annotations

import re
from typing import Any, Optional

_OPTIMIZER_SUFFIXES = (".main_param", ".exp_avg", ".exp_avg_sq", ".momentum_buffer")
_LAYER = r"decoder\.layers\.\d+\."
# (tensor name, the config key each dimension must equal; None: a dimension no single key fixes), most telling
# first: of the tensors that contradict a key, the one of the earliest rule is named.
_RULES: list[tuple[str, tuple[Optional[str], ...]]] = [
    (r"embedding\.word_embeddings\.weight", ("model.vocab_size", "model.hidden_size")),
    (r"output_layer\.weight", ("model.vocab_size", "model.hidden_size")),
    (rf"{_LAYER}mlp\.router\.weight", ("moe.num_experts", "model.hidden_size")),
    (rf"{_LAYER}mlp\.experts\.linear_fc2\.weight", ("moe.num_experts", "model.hidden_size", "moe.ffn_hidden_size")),
    (rf"{_LAYER}mlp\.experts\.linear_fc2\.weight\d+", ("model.hidden_size", "moe.ffn_hidden_size")),
    (rf"{_LAYER}mlp\.experts\.linear_fc1\.weight", ("moe.num_experts", None, "model.hidden_size")),
    (rf"{_LAYER}mlp\.experts\.linear_fc1\.weight\d+", (None, "model.hidden_size")),
    (rf"{_LAYER}mlp\.linear_fc2\.weight", ("model.hidden_size", "model.ffn_hidden_size")),
]  # fmt: skip
_ANY_RULE = re.compile("|".join(f"(?P<r{i}>{name})" for i, (name, _) in enumerate(_RULES)))  # group r<i>: rule i
_LAYER_INDEX = re.compile(r"^decoder\.layers\.(\d+)\.")


def config_misfits(config: Any, tensors: Any) -> list[str]:
    """Each config key that contradicts the recorded tensor shapes, once, naming a tensor that shows it.

    `config` is the manifest's `config` (a dict of sections), `tensors` its `{name: {"shape": [...], ...}}`
    (already checked by `ckpt.manifest`); anything else gives no message."""
    if not isinstance(config, dict) or not isinstance(tensors, dict):
        return []
    wanted = {key: _int_at(config, key) for _, keys in _RULES for key in keys if key is not None}
    found: dict[str, tuple[int, str, str]] = {}  # key -> (rule, tensor, why): the earliest rule's, then name's
    for name, rec in tensors.items():
        # One config for all tensors: a param's own tensor speaks for its optimizer state, expert 0 of a per-expert
        # set for the others; skipping the rest keeps the check of a 50k-tensor manifest to milliseconds.
        if name.endswith(_OPTIMIZER_SUFFIXES) or (name[-1:].isdigit() and not name.endswith("weight0")):
            continue
        m = _ANY_RULE.fullmatch(name)
        if m is None or not isinstance(rec, dict):
            continue
        rule = int(m.lastgroup[1:])  # type: ignore[index]
        keys, shape = _RULES[rule][1], rec.get("shape")
        if not isinstance(shape, list) or len(shape) != len(keys):
            continue
        for dim, key in enumerate(keys):
            want = wanted.get(key) if key is not None else None
            if want is not None and shape[dim] != want and (rule, name) < found.get(key, (len(_RULES), "", ""))[:2]:
                found[key] = (rule, name, f"config {key} is {want}, but tensor {name!r} is {shape} "
                                          f"({shape[dim]} in dim {dim})")  # fmt: skip
    out = {key: why for key, (_, _, why) in found.items()}
    layers = _int_at(config, "model.num_layers")
    if layers is not None:
        beyond = [(int(m.group(1)), n) for n in tensors if (m := _LAYER_INDEX.match(n)) and int(m.group(1)) >= layers]
        if beyond:
            index = max(i for i, _ in beyond)
            name = min(n for i, n in beyond if i == index)
            out["model.num_layers"] = f"config model.num_layers is {layers}, but tensor {name!r} is of layer {index}"
    return [f"{why}: the recorded config does not describe the saved tensors" for why in out.values()]


def _int_at(config: dict[str, Any], key: Optional[str]) -> Optional[int]:
    """The int at dotted `key` of `config`, None when the key is None, absent or not an int."""
    if key is None:
        return None
    section, leaf = key.split(".")
    value = config.get(section, {}).get(leaf) if isinstance(config.get(section), dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
