"""Shared builders for the checkpoint tests (importable by spawned children too: `import ckpt_fixtures`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ckpt import save_checkpoint


def make_meta(**overrides: Any) -> dict[str, Any]:
    """A complete, valid `meta` for save_checkpoint."""
    meta: dict[str, Any] = {
        "consumed_samples": 320,
        "config": {"model": {"num_layers": 2}, "moe": {"num_experts": 4}},
        "expert_layout": "single-grouped",
        "glu_interleave_size": 32,
        "recipe": {"bf16": True, "fp8": None},
        "world": {"dp": 1, "ep": 1, "owners": {"decoder.layers.0.mlp.experts.linear_fc1.weight": 0}},
        "sampler": {"seed": 1234, "epoch": 0, "index": 40},
        "rng": {"torch_cpu": "AAECAwQ=", "python": [3, [1, 2, 3], None]},
        "probe": {"loss": 2.718281828459045, "loss_hex": (2.718281828459045).hex()},
    }
    meta.update(overrides)
    return meta


def mixed_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """One tensor of each dtype the checkpoints hold, plus the awkward shapes (0-d, empty)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "decoder.layers.0.mlp.experts.linear_fc1.weight": torch.randn(4, 16, 8, generator=g),
        "decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(24, 8, generator=g).to(torch.bfloat16),
        "decoder.layers.0.mlp.router.expert_bias": torch.randn(4, generator=g).to(torch.float16),
        "tokens_seen": torch.randint(-(2**40), 2**40, (3,), generator=g, dtype=torch.int64),
        "mask_bytes": torch.randint(0, 256, (5, 3), generator=g, dtype=torch.uint8),
        "decoder.layers.0.mlp.experts.linear_fc2.weight_fp8": torch.randn(4, 8, 16, generator=g).to(torch.float8_e4m3fn),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 7),
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes, for bit-exact comparison of any dtype (NaN and -0.0 included)."""
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def save_simple(root: Path, step: int, seed: int = 0, **kwargs: Any) -> Path:
    """A one-rank checkpoint: model weights in one file, an optimizer moment in another."""
    model = mixed_tensors(seed)
    optim = {"decoder.layers.0.mlp.experts.linear_fc1.weight.exp_avg": torch.full((4, 16, 8), float(seed))}
    files = {"model-00000.safetensors": model, "optim-00000.safetensors": optim}
    return save_checkpoint(root, step, files, make_meta(consumed_samples=step * 32), **kwargs)


def whole_file_digests(step_dir: Path, manifest: dict[str, Any]) -> None:
    """Turn `manifest` (of `step_dir`) into what formats 1-2 recorded for the same files: each file's sha256
    over the whole file, no `file_digest` (ckpt/digest.py). The caller sets `format_version` (and reseals)."""
    import hashlib

    manifest.pop("file_digest", None)
    for fname, rec in manifest["files"].items():
        rec["sha256"] = hashlib.sha256((step_dir / fname).read_bytes()).hexdigest()
