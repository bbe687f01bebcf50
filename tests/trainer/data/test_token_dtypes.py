"""Flat token files: `data.dtype`, exact sizes, the wrong-dtype check, and `data.eval_path`."""

from __future__ import annotations

import struct
from array import array
from pathlib import Path

import pytest
import torch

from moectl.core.config.load import load_config
from moectl.core.config.schema import DataConfig
from moectl.core.errors import DataError
from trainer.data import build_data
from trainer.data.sources import load_tokens
from trainer.loop import Trainer
from trainer.observer import SilentObserver


def gpt2_like(n: int, seed: int = 0, vocab: int = 50257) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def write(path: Path, code: str, ids: list[int], header: bytes = b"") -> str:
    path.write_bytes(header + array(code, ids).tobytes())
    return str(path)


@pytest.mark.parametrize("n", [64, 5000])
@pytest.mark.parametrize("vocab", [50257, 151936, 300])
def test_uint32_file_without_suffix_is_never_read_as_uint16(tmp_path: Path, n: int, vocab: int) -> None:
    ids = gpt2_like(n, vocab=vocab)
    path = write(tmp_path / "train.bin", "I", ids)
    with pytest.raises(DataError, match=r"train\.bin: read as uint16 \(no dtype given: the default\).*holds uint32") as e:
        load_tokens(path)
    assert e.value.fix == "set data.dtype: uint32"
    stream = load_tokens(path, "uint32")
    assert stream.tokens.dtype == torch.uint32 and stream.tokens.tolist() == ids
    assert load_tokens(path, "int32").tokens.tolist() == ids  # the same bytes for ids < 2**31


def test_genuine_uint16_and_uint8_files_pass_the_check(tmp_path: Path) -> None:
    ids = gpt2_like(5000)
    assert load_tokens(write(tmp_path / "a.bin", "H", ids)).tokens.tolist() == ids
    text = list(Path(__file__).read_bytes())
    assert load_tokens(write(tmp_path / "b.bin", "B", text), "uint8").tokens.tolist() == text
    small = [i % 12 for i in range(4000)]  # a tiny vocabulary: every value small, no evidence of a wider dtype
    assert load_tokens(write(tmp_path / "c.bin", "H", small)).tokens.tolist() == small


def test_bytes_stored_as_uint16_but_read_as_uint8_are_caught(tmp_path: Path) -> None:
    path = write(tmp_path / "text.u8.bin", "H", list(Path(__file__).read_bytes()))
    with pytest.raises(DataError, match=r"read as uint8 \(its file name suffix\).*holds uint16 tokens") as e:
        load_tokens(path)
    assert "rename the file" in (e.value.fix or "")
    with pytest.raises(DataError, match=r"read as uint8 \(data.dtype\).*holds uint32"):
        load_tokens(write(tmp_path / "w.bin", "I", gpt2_like(300)), "uint8")


def test_data_dtype_that_contradicts_the_suffix_or_header_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"t\.u16\.bin: data.dtype=uint32 but its file name suffix says uint16"):
        load_tokens(write(tmp_path / "t.u16.bin", "H", gpt2_like(100)), "uint32")
    header = struct.pack("<256i", 20240801, 7, 100, *([0] * 253))
    path = write(tmp_path / "v7.bin", "I", gpt2_like(100), header)
    with pytest.raises(DataError, match=r"data.dtype=uint16 but its llm.c header says uint32"):
        load_tokens(path, "uint16")
    assert load_tokens(path, "uint32").tokens.tolist() == gpt2_like(100)


def test_llmc_header_size_must_be_exact(tmp_path: Path) -> None:
    header = struct.pack("<256i", 20240520, 1, 100, *([0] * 253))
    path = write(tmp_path / "val.bin", "H", gpt2_like(100) + [7] * 2000, header)  # 4,000 trailing bytes
    with pytest.raises(DataError, match=r"val\.bin: 5,224 bytes, but its llm.c header promises 100 uint16 tokens = 1,224"):
        load_tokens(path)
    path = write(tmp_path / "v9.bin", "H", gpt2_like(100), struct.pack("<256i", 20240520, 9, 100, *([0] * 253)))
    with pytest.raises(DataError, match=r"v9\.bin: llm.c magic 20240520 with version 9"):
        load_tokens(path)


def test_out_of_vocab_with_a_guessed_dtype_points_at_the_dtype(tmp_path: Path) -> None:
    text = list(Path(__file__).read_bytes()[:4000])  # bytes, written as uint8, read as the default uint16
    path = write(tmp_path / "bytes.bin", "B", text)
    with pytest.raises(DataError, match=r"bytes\.bin: token id \d+ does not fit model.vocab_size=256") as e:
        build_data(DataConfig(source="tokens", path=path), seq_length=8, vocab_size=256, seed=0)
    assert (e.value.fix or "").startswith("these bytes fit the vocabulary when read as uint8: set data.dtype: uint8")
    train, _ = build_data(DataConfig(source="tokens", path=path, dtype="uint8"), seq_length=8, vocab_size=256, seed=0)
    assert train.tokens.dtype == torch.uint8
    # a genuinely larger vocabulary (header-decided dtype): raising model.vocab_size is the fix
    header = struct.pack("<256i", 20240520, 1, 3000, *([0] * 253))
    path = write(tmp_path / "llmc.bin", "H", gpt2_like(3000), header)
    with pytest.raises(DataError) as e:
        build_data(DataConfig(source="tokens", path=path), seq_length=8, vocab_size=1000, seed=0)
    assert (e.value.fix or "").startswith("set model.vocab_size to at least")


def test_eval_path_is_evaluated_instead_of_a_held_out_fraction(tmp_path: Path) -> None:
    train_path = write(tmp_path / "train.bin", "H", [i % 100 for i in range(3000)])
    val_path = write(tmp_path / "val.bin", "H", [200 + i % 50 for i in range(500)])
    cfg = DataConfig(source="tokens", path=train_path, eval_path=val_path, eval_fraction=0.5)
    train, held = build_data(cfg, seq_length=16, vocab_size=256, seed=0)
    assert len(train) == 3000 and held.tokens.tolist() == [200 + i % 50 for i in range(500)]
    assert held.path == val_path and held.split == "eval" and train.split == "train"
    with pytest.raises(DataError, match=r"val\.bin \(data.eval_path\): 500 tokens, fewer than one sequence"):
        build_data(cfg, seq_length=600, vocab_size=256, seed=0)
    with pytest.raises(DataError, match=r"data.eval_path: .*val\.bin: token id 249 does not fit model.vocab_size=210"):
        build_data(cfg, seq_length=16, vocab_size=210, seed=0)
    with pytest.raises(DataError, match="data.eval_path is set but data.source=synthetic reads no files"):
        build_data(DataConfig(source="synthetic", eval_path=val_path), seq_length=16, vocab_size=256, seed=0)
    with pytest.raises(DataError, match="data.path is set but data.source=corpus reads no files"):
        build_data(DataConfig(source="corpus", path=train_path), seq_length=16, vocab_size=256, seed=0)
    with pytest.raises(DataError, match="data.dtype=uint16 is set but data.source=corpus"):
        build_data(DataConfig(dtype="uint16"), seq_length=16, vocab_size=256, seed=0)


def test_a_missing_eval_file_names_data_eval_path(tmp_path: Path) -> None:
    train_path = write(tmp_path / "train.bin", "H", [i % 100 for i in range(3000)])
    cfg = DataConfig(source="tokens", path=train_path, eval_path=str(tmp_path / "nope.bin"))
    with pytest.raises(DataError) as e:
        build_data(cfg, seq_length=16, vocab_size=256, seed=0)
    assert e.value.message.startswith("data.eval_path: ") and "nope.bin: no such file" in e.value.message
    assert e.value.fix == "check data.eval_path (it names one file)"


def test_eval_path_drives_the_trainers_evaluation(tmp_path: Path) -> None:
    """Same training data, two validation files: identical training, different eval losses."""
    train_path = write(tmp_path / "train.bin", "H", [(i * 7) % 97 for i in range(4000)])
    evals = []
    for name, ids in [("a", [(i * 7) % 97 for i in range(600)]), ("b", [97 + i % 13 for i in range(600)])]:
        val = write(tmp_path / f"{name}.bin", "H", ids)
        cfg = load_config(None, [
            "model.num_layers=1", "model.hidden_size=16", "model.num_attention_heads=2", "model.seq_length=16",
            "model.vocab_size=128", "moe.num_experts=2", "moe.ffn_hidden_size=8", "train.micro_batch_size=2",
            "train.global_batch_size=2", "train.eval_iters=1", "train.train_iters=2", "train.eval_interval=2",
            "optimizer.lr_warmup_iters=0", "data.source=tokens", f"data.path={train_path}",
            f"data.eval_path={val}", f"run_dir={tmp_path / name}",
        ])
        trainer = Trainer(cfg, SilentObserver())
        assert trainer.eval_batches[0][0].max() >= 97 if name == "b" else trainer.eval_batches[0][0].max() < 97
        evals.append(trainer.run())
    assert evals[0].losses == evals[1].losses
    assert evals[0].eval_losses != evals[1].eval_losses
