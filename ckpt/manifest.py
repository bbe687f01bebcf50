"""manifest.json: what a checkpoint holds, written last as its commit marker (docs/checkpoint.md).

Plain JSON only. Layout (format version 3):

    format, format_version, step, writer             # who wrote it: moectl/torch/safetensors versions
    file_digest                                      # "sha256-tree": what files.*.sha256 is (ckpt/digest.py)
    consumed_samples, config, expert_layout,         # the caller's `meta`, checked by `check_meta`
    glu_interleave_size, recipe, world, sampler,
    rng, probe[, train_state][, hf][, scaling]
    files:   {name: {sha256, size, rank}}            # every data file; `rank` = the rank that wrote it
    tensors: {name: {file, dtype, shape, sha256}}    # every tensor; dtype as torch names it
    manifest_sha256                                  # over all the fields above (ckpt/seal.py)

Format 2 is the same without `file_digest`, its files' sha256 being that of the whole file; format 1 also
lacks `manifest_sha256`. Both are still read (ckpt/digest.py, ckpt/seal.py say how and why).

The per-tensor sha256 is over the tensor's bytes in its file; the file's digest covers the header too
(format 3: a tree over the header's and the tensors' sha256s, so every byte is hashed once, in parallel).
Both are checked by `ckpt.integrity`: the file digest proves the file, the tensor hashes name the tensor
when it does not match (Megatron's `integrity.json` has only the former).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import stat
from importlib import metadata as _md
from pathlib import Path
from typing import Any

from ckpt import names
from ckpt import problems as P
from ckpt.config_fit import config_misfits
from ckpt.digest import TREE, TREE_FROM_VERSION
from ckpt.problems import Problem
from ckpt.seal import DIGEST_KEY, SEALED_FROM_VERSION, seal
from ckpt.st_header import TORCH_NAME
from moectl.core.config.schema import SECTIONS

FORMAT = "moectl-checkpoint"
FORMAT_VERSION = 3
FILE_DIGEST_KEY = "file_digest"  # from format 3 on (ckpt/digest.py)
EXPERT_LAYOUTS = ("single-grouped", "per-expert")

# The caller's part of the manifest. train_state (LR schedule, optimizer step counters, skip ranges...)
# is optional so that tools which rewrite a checkpoint (convert) can carry it through untouched.
META_REQUIRED = (
    "consumed_samples", "config", "expert_layout", "glu_interleave_size", "recipe", "world", "sampler", "rng", "probe",
)  # fmt: skip
# hf: the config.json / generation_config.json an import-hf checkpoint came from (ckpt/hf_config.py),
# carried through training and convert so export writes them back. scaling: delayed fp8 scaling's amax
# windows (trainer/checkpointing/scaling_state.py), so a resumed fp8 run quantizes as the saved one would.
META_OPTIONAL = ("train_state", "hf", "scaling")
# The counters of train_state that a resume reads; its other keys are carried through unchecked.
TRAIN_STATE_COUNTERS = ("step", "optimizer_step")
_OWN_KEYS = ("format", "format_version", "step", "writer", "files", "tensors")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_TORCH_DTYPES = frozenset(TORCH_NAME.values())


def _uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_meta(meta: Any) -> list[str]:
    """Everything wrong with a caller's `meta` dict, as messages naming the key (empty when fine)."""
    if not isinstance(meta, dict):
        return [f"meta must be a dict, got {type(meta).__name__}"]
    errs = [f"meta is missing {k!r}" for k in META_REQUIRED if k not in meta]
    errs += [f"meta has unknown key {k!r}" for k in meta if k not in META_REQUIRED + META_OPTIONAL]
    if "consumed_samples" in meta and not _uint(meta["consumed_samples"]):
        errs.append(f"meta consumed_samples must be a non-negative int, got {meta['consumed_samples']!r}")
    if "expert_layout" in meta and meta["expert_layout"] not in EXPERT_LAYOUTS:
        errs.append(f"meta expert_layout must be one of {EXPERT_LAYOUTS}, got {meta['expert_layout']!r}")
    g = meta.get("glu_interleave_size")
    if g is not None and not (_uint(g) and g > 0):
        errs.append(f"meta glu_interleave_size must be a positive int or None, got {g!r}")
    for k in ("config", "recipe", "sampler", "rng", "probe", "train_state", "hf", "scaling"):
        if k in meta and not isinstance(meta[k], dict):
            errs.append(f"meta {k} must be a dict, got {type(meta[k]).__name__}")
    state = meta.get("train_state")
    for k in TRAIN_STATE_COUNTERS if isinstance(state, dict) else ():
        if k in state and not _uint(state[k]):  # a resume counts on them: refuse here, not in int() there
            errs.append(f"meta train_state.{k} must be a non-negative int, got {state[k]!r}")
    errs += _check_read_fields(meta)
    world = meta.get("world")
    if "world" in meta:
        if not isinstance(world, dict):
            errs.append(f"meta world must be a dict, got {type(world).__name__}")
        else:
            for k in ("dp", "ep"):
                if not (_uint(world.get(k)) and world[k] >= 1):
                    errs.append(f"meta world.{k} must be a positive int, got {world.get(k)!r}")
            if not isinstance(world.get("owners"), dict):
                errs.append("meta world.owners must be a dict (which optimizer rank owned which tensor)")
    if not errs:
        try:
            # Strict JSON: NaN/Infinity are not JSON, and a value JSON cannot hold must fail the save now,
            # not the load later. RNG states go in as lists or base64 strings, never pickled bytes.
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            errs.append(f"meta is not strict-JSON serialisable: {e}")
    return errs


def _check_read_fields(meta: dict[str, Any]) -> list[str]:
    """What is wrong with the fields a load reads as more than plain data: the torch RNG state (base64), the probe's
    loss (a number), the recorded config's sections (dicts). A manifest re-sealed with them malformed crashed a
    resume or `ckpt validate` with a traceback; they are refused here, naming the key, as a bad counter is."""
    errs = []
    rng = meta.get("rng")
    if isinstance(rng, dict) and "torch" in rng:  # the state a resume restores (ckpt/logical.py): null included
        torch_rng = rng["torch"]
        if not (isinstance(torch_rng, str) and _is_base64(torch_rng)):
            got = "null" if torch_rng is None else _short(torch_rng)  # as JSON spells it
            errs.append(f"meta rng.torch must be a base64 string, got {got}")
    probe = meta.get("probe")
    if isinstance(probe, dict) and "loss" in probe:
        loss = probe["loss"]
        if not isinstance(loss, (int, float)) or isinstance(loss, bool):  # NaN: the strict-JSON check below
            errs.append(f"meta probe.loss must be a number, got {_short(loss)}")
    if isinstance(probe, dict) and "loss_hex" in probe and not _is_float_hex(probe["loss_hex"]):
        errs.append(f"meta probe.loss_hex must be a float in hex (float.hex), got {_short(probe['loss_hex'])}")
    config = meta.get("config")
    for k in SECTIONS if isinstance(config, dict) else ():
        if k in config and not isinstance(config[k], dict):
            errs.append(f"meta config.{k} must be a dict, got {type(config[k]).__name__}")
    return errs


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _is_float_hex(x: Any) -> bool:
    try:
        return isinstance(x, str) and math.isfinite(float.fromhex(x))
    except ValueError:
        return False


def _short(x: Any) -> str:
    """`x` as a message quotes a value: its repr, cut at 40 characters (a manifest field can be long)."""
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def build(step: int, meta: dict[str, Any], files: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The manifest dict for a save (`meta` already checked), sealed with its digest."""
    return seal({
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "writer": _writer(),
        FILE_DIGEST_KEY: TREE,
        **{k: meta[k] for k in META_REQUIRED + META_OPTIONAL if k in meta},
        "files": dict(sorted(files.items())),
        "tensors": dict(sorted(tensors.items())),
    })  # fmt: skip


def _writer() -> dict[str, str]:
    out = {}
    for pkg in ("moectl", "torch", "safetensors"):
        try:
            out[pkg] = _md.version(pkg)
        except _md.PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def dumps(manifest: dict[str, Any]) -> bytes:
    """Serialise as strict JSON: one top-level key per line, and one line per file and per tensor, so
    `diff` of two manifests shows which tensors changed."""

    def one(v: Any) -> str:
        return json.dumps(v, allow_nan=False, separators=(", ", ": "))

    lines = []
    for k, v in manifest.items():
        if k in ("files", "tensors") and v:
            inner = ",\n".join(f"  {one(name)}: {one(rec)}" for name, rec in v.items())
            lines.append(f" {one(k)}: {{\n{inner}\n }}")
        else:
            lines.append(f" {one(k)}: {one(v)}")
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode("utf-8")


def load(step_dir: Path) -> tuple[dict[str, Any] | None, list[Problem]]:
    """Read and check `step_dir/manifest.json`: (the manifest, or None if unusable; its problems)."""
    path = step_dir / names.MANIFEST
    try:
        present = stat.S_ISREG(path.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        present = False
    except OSError as e:  # a folder this user may not enter (EACCES): unreadable, not uncommitted
        return None, [P.unreadable(None, e, "the folder cannot be read")]
    if not present:
        return None, [Problem(P.INCOMPLETE, names.MANIFEST, None,
                              "missing: the save never committed (manifest.json is written last)")]  # fmt: skip
    try:
        obj = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return None, [Problem(P.MANIFEST, names.MANIFEST, None, f"not valid JSON: {e or type(e).__name__}")]
    except OSError as e:
        return None, [P.unreadable(names.MANIFEST, e)]
    errs = check(obj, names.parse_step_dir(step_dir.name))
    bad = [Problem(P.MANIFEST, names.MANIFEST, None, m) for m in errs]
    return (None if bad else obj), bad


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def check(obj: Any, folder_step: int | None) -> list[str]:
    """Everything wrong with a parsed manifest (schema, version, step vs folder name, a recorded config that does
    not describe the recorded tensor shapes: `ckpt.config_fit`)."""
    if not isinstance(obj, dict):
        return ["is not a JSON object"]
    if obj.get("format") != FORMAT:
        return [f"format is {obj.get('format')!r}, not {FORMAT!r}: not a moectl checkpoint"]
    v = obj.get("format_version")
    if not _uint(v) or v < 1:
        return [f"format_version {v!r} is not a positive int"]
    if v > FORMAT_VERSION:
        return [f"format_version {v} was written by a newer moectl (this one reads up to {FORMAT_VERSION})"]
    own = _OWN_KEYS + ((DIGEST_KEY,) if v >= SEALED_FROM_VERSION else ())
    own += (FILE_DIGEST_KEY,) if v >= TREE_FROM_VERSION else ()
    errs = [f"missing key {k!r}" for k in own if k not in obj]
    if FILE_DIGEST_KEY in obj and v >= TREE_FROM_VERSION and obj[FILE_DIGEST_KEY] != TREE:
        errs.append(f"{FILE_DIGEST_KEY} is {obj[FILE_DIGEST_KEY]!r}, not {TREE!r}: not a digest this moectl computes")
    errs += [f"unknown key {k!r}" for k in obj if k not in own + META_REQUIRED + META_OPTIONAL]
    if DIGEST_KEY in obj and v >= SEALED_FROM_VERSION and not (
        isinstance(obj[DIGEST_KEY], str) and _SHA_RE.match(obj[DIGEST_KEY])
    ):
        errs.append(f"{DIGEST_KEY} is not 64 lowercase hex digits")
    if "writer" in obj and not isinstance(obj["writer"], dict):  # `ckpt inspect` lists its entries
        errs.append(f"writer must be a dict, got {type(obj['writer']).__name__}")
    step = obj.get("step")
    if not _uint(step):
        errs.append(f"step {step!r} is not a non-negative int")
    elif folder_step is not None and step != folder_step:
        errs.append(f"step {step} does not match the folder name (step {folder_step})")
    errs += check_meta({k: obj[k] for k in META_REQUIRED + META_OPTIONAL if k in obj})
    errs += _check_files(obj.get("files"))
    errs += _check_tensors(obj.get("tensors"), obj.get("files"))
    if not errs:  # its shapes are known good: does the recorded config describe them?
        errs += config_misfits(obj.get("config"), obj.get("tensors"))
    return errs


def _check_files(files: Any) -> list[str]:
    if not isinstance(files, dict):
        return ["files must be an object"]
    errs = []
    for name, rec in files.items():
        if not names.SHARD_RE.match(name):
            errs.append(f"files: {name!r} is not a model-/optim-NNNNN.safetensors name")
        if not (isinstance(rec, dict) and set(rec) == {"sha256", "size", "rank"}):
            errs.append(f"files: {name!r} must have exactly sha256, size, rank")
        elif not (isinstance(rec["sha256"], str) and _SHA_RE.match(rec["sha256"])):
            errs.append(f"files: {name!r} sha256 is not 64 lowercase hex digits")
        elif not (_uint(rec["size"]) and _uint(rec["rank"])):
            errs.append(f"files: {name!r} size and rank must be non-negative ints")
    return errs


def _check_tensors(tensors: Any, files: Any) -> list[str]:
    if not isinstance(tensors, dict):
        return ["tensors must be an object"]
    errs = []
    for name, rec in tensors.items():
        if not (isinstance(rec, dict) and set(rec) == {"file", "dtype", "shape", "sha256"}):
            errs.append(f"tensors: {name!r} must have exactly file, dtype, shape, sha256")
            continue
        if not isinstance(files, dict) or rec["file"] not in files:
            errs.append(f"tensors: {name!r} is in file {rec['file']!r}, which files does not list")
        if rec["dtype"] not in _TORCH_DTYPES:
            errs.append(f"tensors: {name!r} dtype {rec['dtype']!r} is not a known dtype")
        if not (isinstance(rec["shape"], list) and all(_uint(d) for d in rec["shape"])):
            errs.append(f"tensors: {name!r} shape {rec['shape']!r} is not a list of non-negative ints")
        if not (isinstance(rec["sha256"], str) and _SHA_RE.match(rec["sha256"])):
            errs.append(f"tensors: {name!r} sha256 is not 64 lowercase hex digits")
    return errs
