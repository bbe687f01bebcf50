"""Checkpoints of real `GPTMoE` models for the convert / HF tests: the model's state dict in model files,
random fp32 masters and Adam moments for every parameter in optim files, and a manifest meta built from the
model's config (as the training integration will write it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from ckpt import save_checkpoint
from moectl.core.config import Config, config_to_dict
from moectl.core.config.schema import ModelConfig, MoEConfig
from trainer.model import GPTMoE

OPTIM_SUFFIXES = (".main_param", ".exp_avg", ".exp_avg_sq")


def tiny_config(model: Optional[dict[str, Any]] = None, moe: Optional[dict[str, Any]] = None) -> Config:
    """A small model: 2 layers, D 32, 4 query heads over 2 kv groups, 4 experts of F 64, top-2."""
    m = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64, seq_length=16)
    e = dict(num_experts=4, router_topk=2, ffn_hidden_size=64, backend="loop")
    return Config(model=ModelConfig(**{**m, **(model or {})}), moe=MoEConfig(**{**e, **(moe or {})}))


def build_model(cfg: Config, seed: int = 1, dtype: torch.dtype = torch.float32) -> GPTMoE:
    """A model whose every tensor is distinct: norms and biases are randomised too (they start at 1 and 0)."""
    model = GPTMoE(cfg.model, cfg.moe, seed=seed, params_dtype=dtype).eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif ".bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def fake_optimizer(state: dict[str, torch.Tensor], seed: int = 2) -> dict[str, torch.Tensor]:
    """Random fp32 `.main_param`, `.exp_avg`, `.exp_avg_sq` for every tensor of `state`."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        for s in OPTIM_SUFFIXES:
            x = torch.randn(t.shape, generator=g, dtype=torch.float32)
            out[name + s] = x.abs() if s == ".exp_avg_sq" else x
    return out


def meta_for(cfg: Config, **overrides: Any) -> dict[str, Any]:
    layout = "single-grouped" if cfg.moe.single_grouped_weight else "per-expert"
    meta: dict[str, Any] = {
        "consumed_samples": 448,
        "config": config_to_dict(cfg),
        "expert_layout": layout,
        "glu_interleave_size": cfg.moe.glu_interleave_size,
        "recipe": {"bf16": cfg.mixed_precision.bf16},
        "world": {"dp": 2, "ep": 1, "owners": {"embedding.word_embeddings.weight": 1}},
        "sampler": {"seed": 1234, "index": 7},
        "rng": {"torch_cpu": "AAEC"},
        "probe": {"loss": 4.25, "loss_hex": (4.25).hex()},
        "train_state": {"lr": 0.001, "optimizer_step": 7},
    }
    meta.update(overrides)
    return meta


def save_model_checkpoint(
    root: Path,
    cfg: Config,
    state: dict[str, torch.Tensor],
    optim: Optional[dict[str, torch.Tensor]] = None,
    step: int = 7,
    files: Optional[dict[str, dict[str, torch.Tensor]]] = None,
) -> Path:
    """Save `state` (+ `optim`) as model-00000 / optim-00000, or as the given `files`."""
    if files is None:
        files = {"model-00000.safetensors": state}
        if optim:
            files["optim-00000.safetensors"] = optim
    return save_checkpoint(root, step, files, meta_for(cfg))


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, for bit-exact comparison of any dtype."""
    return t.contiguous().view(-1).view(torch.uint8)


def read_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (verified)."""
    from ckpt import open_checkpoint

    with open_checkpoint(path) as ck:
        return {n: ck.read(n) for n in ck.tensor_names()}


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes."""
    assert sorted(got) == sorted(want), set(got) ^ set(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        assert torch.equal(bits(got[n]), bits(t)), n
