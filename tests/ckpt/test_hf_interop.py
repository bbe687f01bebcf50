"""Published HF MoE shapes round-trip through moectl: import -> validate -> train -> export -> transformers.

Tiny widths, the published peculiarities kept: Qwen3-MoE with head_dim != hidden / heads (Qwen3-30B-A3B:
128 vs 2048 / 32; here 16 vs 32 / 4) and all-MoE layers with a dense intermediate_size on record; Mixtral
with bos/eos token ids, its own router_aux_loss_coef and a generation_config.json. Each model is written by
transformers' save_pretrained, imported without a moectl config, validated (weights, digests, the probe),
trained 3 steps from the config the import wrote, exported, and loaded back by from_pretrained: logits
match moectl's within 1e-5, and every config field the import read comes back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckpt import open_checkpoint, resolve_load_path
from ckpt.hf import export_hf, import_hf
from moectl.core.config.load import apply_overrides, load_config
from trainer.validation import probe_loss_of_weights
from trainer.validation import validate_checkpoint
from trainer.loop import Trainer
from trainer.observer import SilentObserver

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.05,
              router_aux_loss_coef=0.003, tie_word_embeddings=False)  # fmt: skip
TRAIN = ["data.source=synthetic", "model.seq_length=16", "train.micro_batch_size=2", "train.global_batch_size=2",
         "train.eval_interval=null", "optimizer.lr_warmup_iters=0", "optimizer.lr=1e-2"]  # fmt: skip


def _hf_folder(tmp: Path, kind: str) -> Path:
    torch.manual_seed(0)
    if kind == "qwen3-moe":
        cfg = transformers.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, moe_intermediate_size=24,
                                          intermediate_size=48, norm_topk_prob=True, rope_theta=1e6,
                                          bos_token_id=5, eos_token_id=6)  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(**COMMON, num_local_experts=4, intermediate_size=24, rope_theta=1e6,
                                         bos_token_id=1, eos_token_id=2)  # fmt: skip
        model = transformers.MixtralForCausalLM(cfg)
        model.generation_config.max_new_tokens = 77  # something only a generation_config.json carries
    folder = tmp / f"{kind}-hf"
    model.save_pretrained(folder)
    return folder


def _logits(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model.eval()(tokens)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral"])
def test_published_shapes_round_trip_through_training(tmp_path: Path, kind: str) -> None:
    src = _hf_folder(tmp_path, kind)
    read = json.loads((src / "config.json").read_text())
    step0 = import_hf(src, tmp_path / "checkpoints", base=apply_overrides({}, TRAIN), probe=probe_loss_of_weights)
    written = tmp_path / "checkpoints" / "config.yaml"
    cfg = load_config(written)
    assert cfg.model.head_dim == (16 if kind == "qwen3-moe" else 8)
    assert cfg.model.kv_channels == (16 if kind == "qwen3-moe" else None)
    assert cfg.checkpoint.load == str(tmp_path / "checkpoints") and cfg.run_dir == str(tmp_path)

    report = validate_checkpoint(step0)
    assert report.ok, [c for c in report.failures()]
    assert any(c.stage == "master" and "model weights only" in c.detail for c in report.checks)
    assert report.counts["weight"] == len(list(Trainer(cfg, SilentObserver()).model.parameters()))
    probe = next(c for c in report.checks if c.stage == "probe")
    assert "bitwise" in probe.detail

    trainer = Trainer(load_config(written, ["train.train_iters=3", "checkpoint.save_interval=3"]), SilentObserver())
    assert trainer.weights_only
    result = trainer.run()
    assert len(result.losses) == 3 and all(torch.isfinite(torch.tensor(result.losses)))
    trained = resolve_load_path(tmp_path / "checkpoints")
    assert trained.name == "step_00000003"
    with open_checkpoint(trained) as ck:
        assert ck.meta["hf"]["config"] == read  # the import's record survives training

    out = export_hf(trained, tmp_path / "exported", kind)
    cls = transformers.Qwen3MoeForCausalLM if kind == "qwen3-moe" else transformers.MixtralForCausalLM
    hf, info = cls.from_pretrained(out, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    torch.testing.assert_close(_logits(hf), _logits(trainer.model), rtol=0, atol=1e-5)

    back = json.loads((out / "config.json").read_text())
    kept = {k: v for k, v in read.items() if k not in ("dtype", "torch_dtype", "transformers_version")}
    assert {k: back.get(k) for k in kept} == kept  # every field the import read, as it read it
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (read["bos_token_id"], read["eos_token_id"])
    if kind == "mixtral":
        assert gen["max_new_tokens"] == 77
    assert back["head_dim"] == (16 if kind == "qwen3-moe" else None)  # Mixtral: null, i.e. hidden / heads


def test_an_import_without_probe_fails_only_the_probe_saying_why(tmp_path: Path) -> None:
    step0 = import_hf(_hf_folder(tmp_path, "mixtral"), tmp_path / "ck",
                      base=apply_overrides({}, ["data.source=synthetic"]))
    report = validate_checkpoint(step0)
    assert [(c.stage, c.detail) for c in report.failures()] == [
        ("probe", "the checkpoint records no probe loss (imported with --no-probe)")
    ]


# The config.json files of Qwen/Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1 as published on the Hugging
# Face hub (copied by hand: tests download nothing). Their model cards give the sizes checked below.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "vocab_size": 32000,
}  # fmt: skip


@pytest.mark.parametrize(
    "published,fmt,head_dim,total,active",
    [(QWEN3_30B_A3B, "qwen3-moe", 128, 30.5e9, 3.3e9), (MIXTRAL_8X7B, "mixtral", 128, 46.7e9, 12.9e9)],
)
def test_published_configs_map_exactly_both_ways(published: dict, fmt: str, head_dim: int, total: float,
                                                 active: float) -> None:
    from ckpt.hf_config import FAMILIES, hf_config, moectl_config, origin_meta
    from moectl.core.summary import param_counts

    fam = FAMILIES[fmt]
    cfg = moectl_config(published, fam)
    assert cfg.model.head_dim == head_dim
    assert cfg.model.kv_channels == (128 if fmt == "qwen3-moe" else None)  # 2048 / 32 = 64 would be wrong
    counts = param_counts(cfg, 1)
    assert counts.total == pytest.approx(total, rel=0.005) and counts.active == pytest.approx(active, rel=0.02)
    back = hf_config(cfg, fam, torch.bfloat16, origin_meta(fam, published, None))
    assert {k: back[k] for k in published} == published
    # transformers reads it as the same architecture
    hf_cfg = getattr(transformers, fam.architecture.replace("ForCausalLM", "Config"))(**back)
    assert (hf_cfg.hidden_size, hf_cfg.num_attention_heads) == (published["hidden_size"], 32)
    if fmt == "qwen3-moe":
        assert hf_cfg.head_dim == 128
