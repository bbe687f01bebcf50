"""HF export/import against transformers' own Mixtral and Qwen3-MoE classes (tiny random configs, fp32, no
download): logits match moectl's forward, import round-trips bit for bit (per-expert and v5 fused keys), and
every refusal names what differs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from moe_ckpt_fixtures import assert_same_tensors, build_model, fake_optimizer, read_all, save_model_checkpoint, tiny_config
from safetensors.torch import load_file, save_file

from ckpt import open_checkpoint
from ckpt.hf import export_hf, import_hf
from moectl.core.config import Config
from moectl.core.config.load import apply_overrides
from moectl.core.errors import CheckpointArgumentError, CheckpointError

MIXTRAL = {"model": {"rotary_base": 5000.0}, "moe": {"router_norm_topk_prob": True, "glu_interleave_size": 32,
                                                      "single_grouped_weight": False}}  # fmt: skip
QWEN = {"model": {"qk_layernorm": True, "tie_embeddings": True, "moe_layer_freq": [0, 1], "ffn_hidden_size": 48,
                  "norm_epsilon": 1e-6, "rotary_base": 1e6}, "moe": {"ffn_hidden_size": 32}}  # fmt: skip


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))


def _exported(tmp: Path, cfg: Config, fmt: str) -> tuple[dict[str, torch.Tensor], torch.Tensor, Path]:
    """(moectl model state, its logits, the exported HF folder) for a checkpoint with optimizer state."""
    model = build_model(cfg)
    state = model.state_dict()
    ck = save_model_checkpoint(tmp / "ck", cfg, state, fake_optimizer(state))
    with torch.no_grad():
        logits = model(_tokens())
    return state, logits, export_hf(ck, tmp / "hf", fmt)


def _hf_logits(cls: Any, folder: Path) -> tuple[Any, torch.Tensor]:
    hf, info = cls.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        return hf, hf.eval()(_tokens()).logits


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("mixtral")
    cfg = tiny_config(**MIXTRAL)
    state, logits, folder = _exported(tmp, cfg, "mixtral")
    hf, hf_logits = _hf_logits(transformers.MixtralForCausalLM, folder)
    return {"cfg": cfg, "state": state, "logits": logits, "folder": folder, "hf": hf, "hf_logits": hf_logits}


def test_mixtral_export_matches_transformers_logits(mixtral: dict[str, Any]) -> None:
    torch.testing.assert_close(mixtral["hf_logits"], mixtral["logits"], rtol=0, atol=1e-5)
    c = json.loads((mixtral["folder"] / "config.json").read_text())
    assert c["architectures"] == ["MixtralForCausalLM"] and c["num_local_experts"] == 4
    assert (c["intermediate_size"], c["head_dim"], c["num_key_value_heads"], c["rope_theta"]) == (64, 8, 2, 5000.0)
    names = set(load_file(mixtral["folder"] / "model.safetensors"))
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in names and "lm_head.weight" in names


def test_mixtral_import_round_trips_bit_exact(mixtral: dict[str, Any], tmp_path: Path) -> None:
    out = import_hf(mixtral["folder"], tmp_path / "back", base=apply_overrides({}, ["moe.single_grouped_weight=false",
                                                                     "moe.glu_interleave_size=32"]))  # fmt: skip
    assert out == tmp_path / "back" / "step_00000000"
    assert_same_tensors(read_all(out), mixtral["state"])
    with open_checkpoint(out) as ck:
        m = ck.meta
    assert (m["expert_layout"], m["glu_interleave_size"], m["config"]["moe"]["router_norm_topk_prob"]) == ("per-expert", 32, True)
    assert (m["config"]["model"]["rotary_base"], m["config"]["model"]["num_query_groups"]) == (5000.0, 2)


def test_import_reads_transformers_v5_fused_experts(mixtral: dict[str, Any], tmp_path: Path) -> None:
    # what a v5 model holds in memory: mlp.experts.gate_up_proj [E, 2F, D] / down_proj [E, D, F], router mlp.gate
    sd = {n: t.contiguous() for n, t in mixtral["hf"].state_dict().items()}
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 32)
    folder = tmp_path / "fused"
    folder.mkdir()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(mixtral["folder"] / "config.json", folder / "config.json")
    out = import_hf(folder, tmp_path / "ck", base=apply_overrides({}, ["moe.single_grouped_weight=false", "moe.glu_interleave_size=32"]))
    assert_same_tensors(read_all(out), mixtral["state"])


def test_qwen3_moe_export_matches_transformers_logits_and_imports_back(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config(**QWEN)
    state, logits, folder = _exported(tmp_path, cfg, "qwen3-moe")
    c = json.loads((folder / "config.json").read_text())
    assert (c["mlp_only_layers"], c["norm_topk_prob"], c["moe_intermediate_size"], c["intermediate_size"]) == ([0], False, 32, 48)
    assert c["tie_word_embeddings"] is True and "lm_head.weight" not in load_file(folder / "model.safetensors")
    _, hf_logits = _hf_logits(transformers.Qwen3MoeForCausalLM, folder)
    torch.testing.assert_close(hf_logits, logits, rtol=0, atol=1e-5)
    out = import_hf(folder, tmp_path / "back")
    assert_same_tensors(read_all(out), state)
    with open_checkpoint(out) as ck:
        model_cfg = ck.meta["config"]["model"]
    assert (model_cfg["moe_layer_freq"], model_cfg["qk_layernorm"], model_cfg["tie_embeddings"]) == ([0, 1], True, True)


def test_sharded_export_imports_back(tmp_path: Path) -> None:
    cfg = tiny_config(**QWEN)
    state = build_model(cfg).state_dict()
    ck = save_model_checkpoint(tmp_path / "ck", cfg, state)
    folder = export_hf(ck, tmp_path / "hf", "qwen3-moe", max_shard_bytes=40_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    out = import_hf(folder, tmp_path / "back", max_shard_bytes=40_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert_same_tensors(read_all(out), state)


def test_export_refuses_what_mixtral_cannot_express_naming_each(tmp_path: Path) -> None:
    cfg = tiny_config(model={"moe_layer_freq": [1, 0], "qk_layernorm": True},
                      moe={"router_score_function": "sigmoid", "add_bias": True, "activation": "squared_relu",
                           "capacity_factor": 1.5})  # fmt: skip
    ck = save_model_checkpoint(tmp_path / "ck", cfg, build_model(cfg).state_dict())
    with pytest.raises(CheckpointError) as e:
        export_hf(ck, tmp_path / "hf", "mixtral")
    for what in ("moe.router_score_function=sigmoid", "moe.activation=squared_relu", "moe.add_bias=true",
                 "moe.capacity_factor=1.5", "moe.router_norm_topk_prob=false", "layers [1] dense",
                 "model.qk_layernorm=true"):  # fmt: skip
        assert what in e.value.message, what
    plain = tiny_config()
    ck = save_model_checkpoint(tmp_path / "plain", plain, build_model(plain).state_dict())
    with pytest.raises(CheckpointError, match=r"as qwen3-moe: model\.qk_layernorm=false \(Qwen3Moe always has q_norm/k_norm\)$"):
        export_hf(ck, tmp_path / "hf", "qwen3-moe")
    assert not (tmp_path / "hf").exists()


def _edit_config(folder: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(folder, dst)
    c = json.loads((dst / "config.json").read_text())
    c.update(changes)
    (dst / "config.json").write_text(json.dumps(c))
    return dst


@pytest.fixture()
def qwen_folder(tmp_path: Path) -> Path:
    cfg = tiny_config(**QWEN)
    ck = save_model_checkpoint(tmp_path / "src", cfg, build_model(cfg).state_dict())
    return export_hf(ck, tmp_path / "hf", "qwen3-moe")


def test_import_refuses_architectures_moectl_cannot_express(qwen_folder: Path, tmp_path: Path) -> None:
    bad = _edit_config(qwen_folder, tmp_path / "bad", hidden_act="gelu", head_dim=7, use_sliding_window=True,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, attention_bias=True)  # fmt: skip
    with pytest.raises(CheckpointError) as e:
        import_hf(bad, tmp_path / "out")
    for what in ('hidden_act="gelu"', "head_dim=7 (must be a positive even int", "use_sliding_window=true", '"rope_type": "yarn"', "attention_bias=true"):
        assert what in e.value.message, what
    other = _edit_config(qwen_folder, tmp_path / "llama", model_type="llama")
    with pytest.raises(CheckpointError, match="model_type 'llama' is not supported"):
        import_hf(other, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_names_missing_unexpected_and_misshaped_tensors(qwen_folder: Path, tmp_path: Path) -> None:
    sd = load_file(qwen_folder / "model.safetensors")
    del sd["model.layers.1.mlp.experts.2.up_proj.weight"]
    sd["model.layers.1.mlp.experts.4.up_proj.weight"] = torch.zeros(32, 32)  # a fifth expert of four
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    (tmp_path / "bad").mkdir()
    shutil.copy(qwen_folder / "config.json", tmp_path / "bad" / "config.json")
    save_file(sd, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        import_hf(tmp_path / "bad", tmp_path / "out")
    msg = e.value.message
    assert "missing 1 tensor(s): model.layers.1.mlp.experts.2.up_proj.weight" in msg
    assert "unexpected 1 tensor(s): model.layers.1.mlp.experts.4.up_proj.weight" in msg
    assert "model.layers.0.self_attn.k_proj.weight is [8, 32], expected [16, 32]" in msg


def test_import_config_may_not_contradict_the_architecture(qwen_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointArgumentError, match=r"model\.hidden_size=64 \(the HF model has 32\)") as err:
        import_hf(qwen_folder, tmp_path / "out", base=apply_overrides({}, ["model.hidden_size=64", "train.seed=7"]))
    assert err.value.exit_code == 2 and "drop model.hidden_size from --set/--config" in err.value.one_line()
    out = import_hf(qwen_folder, tmp_path / "ok", base=apply_overrides({}, ["train.seed=7", "moe.single_grouped_weight=false"]))
    with open_checkpoint(out) as ck:
        assert ck.meta["config"]["train"]["seed"] == 7 and ck.meta["expert_layout"] == "per-expert"


def test_tied_lm_head_copy_is_accepted_only_if_it_is_the_embedding(qwen_folder: Path, tmp_path: Path) -> None:
    sd = load_file(qwen_folder / "model.safetensors")
    for name, head in (("same", sd["model.embed_tokens.weight"].clone()), ("diff", torch.zeros(64, 32))):
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(qwen_folder / "config.json", folder / "config.json")
        save_file({**sd, "lm_head.weight": head}, str(folder / "model.safetensors"))
    assert "output_layer.weight" not in read_all(import_hf(tmp_path / "same", tmp_path / "out1"))
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight"):
        import_hf(tmp_path / "diff", tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_import_never_loads_pickles(qwen_folder: Path, tmp_path: Path) -> None:
    (tmp_path / "pt").mkdir()
    shutil.copy(qwen_folder / "config.json", tmp_path / "pt" / "config.json")
    (tmp_path / "pt" / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError, match=r"holds no \*\.safetensors weights \(pytorch_model\.bin are pickles"):
        import_hf(tmp_path / "pt", tmp_path / "out")


def test_an_interrupted_import_leaves_nothing_and_can_be_run_again(qwen_folder: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """As convert: a Ctrl-C during the save left a checkpoint-sized `.tmp-` folder, and the rerun was refused."""
    import ckpt.hf as hf

    real, calls = hf._from_hf, []

    def interrupted(source: Any, *a: Any, **kw: Any) -> Any:
        if not source.dry:
            calls.append(1)
            if len(calls) == 2:  # the save's folder exists by now
                assert any(".tmp-" in p.name for p in (tmp_path / "back").iterdir())
                raise KeyboardInterrupt
        return real(source, *a, **kw)

    monkeypatch.setattr(hf, "_from_hf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        import_hf(qwen_folder, tmp_path / "back")
    assert not (tmp_path / "back").exists()
    monkeypatch.setattr(hf, "_from_hf", real)
    assert import_hf(qwen_folder, tmp_path / "back").is_dir()
