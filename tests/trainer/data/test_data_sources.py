"""Each source reads a small file the test writes, in the format its module documents."""

from __future__ import annotations

import json
import struct
import sys
import time
from array import array
from pathlib import Path

import pytest
import torch

import trainer.data.sources.text as text_source
from moectl.core.config.schema import DataConfig
from moectl.core.errors import DataError
from trainer.data import build_data, load_source
from trainer.data.sources import build_corpus, build_synthetic, load_megatron, load_text, load_tokens
from trainer.data.sources.corpus import MAX_BYTES
from trainer.data.storage import fingerprint

IDS = [5, 0, 65535, 17, 300, 2, 9, 1000]


def write_array(path: Path, code: str, values: list[int], header: bytes = b"") -> Path:
    path.write_bytes(header + array(code, values).tobytes())
    return path


# --- tokens -------------------------------------------------------------------------------------------


def test_tokens_uint16_is_the_nanogpt_default(tmp_path: Path) -> None:
    s = load_tokens(str(write_array(tmp_path / "train.bin", "H", IDS)))
    assert s.tokens.dtype == torch.uint16 and s.tokens.tolist() == IDS


@pytest.mark.parametrize("name", ["train.u32.bin", "train.uint32.bin"])
def test_tokens_uint32_by_suffix(tmp_path: Path, name: str) -> None:
    ids = IDS + [70_000, 151_000]
    s = load_tokens(str(write_array(tmp_path / name, "I", ids)))
    assert s.tokens.dtype == torch.uint32 and s.tokens.tolist() == ids


@pytest.mark.parametrize("magic,version,code", [(20240520, 1, "H"), (20240801, 7, "I")])
def test_tokens_llmc_header(tmp_path: Path, magic: int, version: int, code: str) -> None:
    header = struct.pack("<256i", magic, version, len(IDS), *([0] * 253))
    s = load_tokens(str(write_array(tmp_path / "fineweb_val_000000.bin", code, IDS, header)))
    assert s.tokens.tolist() == IDS and s.notes["format"] == "llm.c"


def test_tokens_odd_size_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="odd.bin.*whole number of uint16") as e:
        load_tokens(str(path))
    # the fix names the flag and the dtypes that fit (it pointed at a source file)
    assert "(whole at this size: uint8; e.g. --set data.dtype=uint8)" in e.value.fix and ".py" not in e.value.fix


# --- megatron -----------------------------------------------------------------------------------------


def write_megatron(
    prefix: Path,
    docs: list[list[list[int]]],
    code: int = 8,
    fmt: str = "H",
    magic: bytes = b"MMIDIDX\x00\x00",
    reverse_bin: bool = False,
) -> None:
    """Write `docs` (documents of sequences of ids) as Megatron's builder does (or with the .bin reversed)."""
    seqs = [seq for doc in docs for seq in doc]
    itemsize = struct.calcsize("<" + fmt)
    order = list(reversed(range(len(seqs)))) if reverse_bin else list(range(len(seqs)))
    pointers, blob, at = [0] * len(seqs), b"", 0
    for i in order:  # the .bin holds sequences in `order`; the pointers say where each one is
        pointers[i] = at
        blob += struct.pack(f"<{len(seqs[i])}{fmt}", *seqs[i])
        at += len(seqs[i]) * itemsize
    doc_idx = [0]
    for doc in docs:
        doc_idx.append(doc_idx[-1] + len(doc))
    idx = magic + struct.pack("<QBQQ", 1, code, len(seqs), len(doc_idx))
    idx += struct.pack(f"<{len(seqs)}i", *map(len, seqs))
    idx += struct.pack(f"<{len(seqs)}q", *pointers)
    idx += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    Path(f"{prefix}.idx").write_bytes(idx)
    Path(f"{prefix}.bin").write_bytes(blob)


DOCS = [[[1, 2, 3], [4, 5]], [[6]], [[7, 8, 9, 10]]]
FLAT = [t for doc in DOCS for seq in doc for t in seq]


@pytest.mark.parametrize("code,fmt,dtype", [(8, "H", torch.uint16), (4, "i", torch.int32), (1, "B", torch.uint8)])
def test_megatron_pair_reads_documents_in_order(tmp_path: Path, code: int, fmt: str, dtype: torch.dtype) -> None:
    write_megatron(tmp_path / "wiki_text_document", DOCS, code, fmt)
    s = load_megatron(str(tmp_path / "wiki_text_document"))
    assert s.tokens.dtype == dtype and s.tokens.tolist() == FLAT
    assert s.notes == {"sequences": 4, "documents": 3}
    assert load_megatron(str(tmp_path / "wiki_text_document.bin")).tokens.tolist() == FLAT  # .bin path works too


def test_megatron_follows_pointers_when_the_bin_is_not_in_index_order(tmp_path: Path) -> None:
    write_megatron(tmp_path / "d", DOCS, reverse_bin=True)
    assert load_megatron(str(tmp_path / "d")).tokens.tolist() == FLAT


def test_megatron_folder_as_data_path_is_named_a_folder_with_its_prefixes(tmp_path: Path) -> None:
    """A folder (trailing slash or not) said "<folder>.idx: no such file", a file the user never named."""
    write_megatron(tmp_path / "wiki_text_document", DOCS)
    for path in (str(tmp_path), f"{tmp_path}/"):
        with pytest.raises(DataError) as e:
            load_source(DataConfig(source="megatron", path=path), vocab_size=70_000, seed=0)
        assert e.value.message == f"{tmp_path}: a folder, not a Megatron prefix", e.value.message
        assert f"(here: {tmp_path / 'wiki_text_document'})" in (e.value.fix or "")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="a folder, not a Megatron prefix") as e:
        load_megatron(str(tmp_path / "empty"))
    assert "holds no .idx file" in (e.value.fix or "")


def test_megatron_prefix_of_a_flat_token_file_says_so(tmp_path: Path) -> None:
    """A nanoGPT train.bin given to the megatron source: its missing index is named, with the tokens source."""
    write_array(tmp_path / "train.bin", "H", IDS)
    with pytest.raises(DataError) as e:
        load_megatron(str(tmp_path / "train"))
    assert "train.bin has no Megatron index" in e.value.message and "data.source: tokens" in (e.value.fix or "")


def test_megatron_bad_magic_names_the_index(tmp_path: Path) -> None:
    write_megatron(tmp_path / "d", DOCS, magic=b"TNTIDX\x00\x00\x00")
    with pytest.raises(DataError, match=r"d\.idx.*bad magic"):
        load_megatron(str(tmp_path / "d"))


def test_megatron_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nothing\.idx: no such file"):
        load_megatron(str(tmp_path / "nothing"))
    write_megatron(tmp_path / "d", DOCS)
    (tmp_path / "d.bin").write_bytes(b"\x01\x00")  # truncated .bin
    with pytest.raises(DataError, match=r"d\.bin: 2 bytes, but d\.idx accounts for 10 uint16 tokens = 20 bytes"):
        load_megatron(str(tmp_path / "d"))
    (tmp_path / "d.bin").unlink()
    with pytest.raises(DataError, match=r"d\.bin: no such file"):
        load_megatron(str(tmp_path / "d"))
    write_megatron(tmp_path / "t", DOCS)
    idx = tmp_path / "t.idx"
    idx.write_bytes(idx.read_bytes()[:40])
    with pytest.raises(DataError, match=r"t\.idx: truncated"):
        load_megatron(str(tmp_path / "t"))
    write_megatron(tmp_path / "f", DOCS, code=7, fmt="f")
    with pytest.raises(DataError, match=r"f\.idx: float tokens"):
        load_megatron(str(tmp_path / "f"))


# --- text ---------------------------------------------------------------------------------------------


def test_text_txt_is_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "tiny.txt"
    path.write_text("héllo\nworld\n", encoding="utf-8")
    s = load_text(str(path))
    assert s.tokens.dtype == torch.uint8 and bytes(s.tokens.tolist()) == "héllo\nworld\n".encode()


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_text_txt_in_utf16_or_32_is_refused_by_its_byte_order_mark(tmp_path: Path, encoding: str) -> None:
    """Read as bytes, every other token would be an encoding's zero byte; UTF-8 (with or without a BOM) reads."""
    path = tmp_path / "a.txt"
    path.write_text("hello world", encoding=encoding)  # Python writes the platform's BOM first
    with pytest.raises(DataError, match=f"{encoding.upper()} text") as e:
        load_text(str(path))
    assert f"iconv -f {encoding.upper()} -t UTF-8" in e.value.one_line()
    path.write_text("hello", encoding="utf-8-sig")
    assert load_text(str(path)).tokens.numel() == 8


def test_text_txt_that_is_not_utf8_is_refused_naming_the_byte(tmp_path: Path) -> None:
    """Read as bytes, a Latin-1 or binary .txt trained without a word (a user trial); .jsonl already refused."""
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(DataError) as e:
        load_text(str(path))
    line = e.value.one_line()
    assert f"{path}: not UTF-8 at byte 3 (invalid continuation byte)" in line and "iconv" in line, line
    path.write_bytes("caf\u00e9".encode()[:-1])  # cut inside its last character
    with pytest.raises(DataError, match="not UTF-8 at byte 3 \\(unexpected end of data\\)"):
        load_text(str(path))


def test_text_txt_utf8_check_reads_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A character cut by a chunk boundary is whole; a bad byte after it is named at its offset in the file."""
    monkeypatch.setattr(text_source, "UTF8_CHUNK", 4)
    path = tmp_path / "t.txt"
    path.write_bytes("abc\u00e9\u20acxyz".encode())  # é straddles bytes 3-4, € bytes 5-7
    assert bytes(load_text(str(path)).tokens.tolist()).decode() == "abc\u00e9\u20acxyz"
    path.write_bytes("abc\u00e9".encode() + b"x\xffyz")
    with pytest.raises(DataError, match="not UTF-8 at byte 6 "):
        load_text(str(path))


def test_text_jsonl_joins_records_with_nul(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "ab", "id": 1}\n\n{"text": "ç"}\n', encoding="utf-8")
    s = load_text(str(path))
    assert bytes(s.tokens.tolist()) == b"ab\x00" + "ç".encode() and s.notes["documents"] == 2


def test_text_jsonl_bad_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no text"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r'docs\.jsonl:2: no string field "text"'):
        load_text(str(path))
    path.write_text('{"text": "ok"}\nnot json\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"docs\.jsonl:2: not valid JSON"):
        load_text(str(path))


def test_text_tokenizer_without_the_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny.txt"
    path.write_text("hello", encoding="utf-8")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise ImportError
    with pytest.raises(DataError) as err:
        load_text(str(path), str(tmp_path / "tokenizer.json"))
    assert err.value.fix == "pip install moectl[tokenizers]"


def test_text_with_a_local_tokenizer_json(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers", reason="optional extra moectl[tokenizers] is not installed")
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "hello": 2, "world": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "hello world"}\n{"text": "world zzz"}\n', encoding="utf-8")
    s = load_text(str(path), str(tmp_path / "tokenizer.json"))
    assert s.tokens.tolist() == [2, 3, 0, 3, 1, 0] and s.notes["end_token"] == "<|endoftext|>"


# --- corpus and synthetic -----------------------------------------------------------------------------


def test_corpus_is_deterministic_cached_and_large(tmp_path: Path) -> None:
    built = build_corpus(cache_dir=tmp_path)
    t0 = time.perf_counter()
    cached = build_corpus(cache_dir=tmp_path)
    assert time.perf_counter() - t0 < 1.0
    uncached = build_corpus(cache_dir=None)
    assert len(built) > 1_000_000 and len(built) <= MAX_BYTES and built.tokens.dtype == torch.uint8
    assert built.path == cached.path and Path(built.path).name.startswith(f"corpus-py{sys.version_info[0]}.")
    assert built.fingerprint == cached.fingerprint == uncached.fingerprint and built.fingerprint.full
    assert torch.equal(built.tokens, uncached.tokens)
    assert b"def " in bytes(built.tokens[:100_000].tolist())  # it is Python source
    assert [p.name for p in tmp_path.iterdir()] == [Path(built.path).name]  # no temp files left behind


def test_synthetic_is_deterministic_bounded_and_predictable() -> None:
    a = build_synthetic(vocab_size=97, seed=3, num_tokens=20_000)
    assert torch.equal(a.tokens, build_synthetic(vocab_size=97, seed=3, num_tokens=20_000).tokens)
    assert not torch.equal(a.tokens, build_synthetic(vocab_size=97, seed=4, num_tokens=20_000).tokens)
    t = a.tokens.long()
    assert int(t.min()) >= 0 and int(t.max()) == 96
    # Learnable: nearly every token follows from the last few (a repeat of period <= 8, or a constant step).
    x = t[16:]
    repeats = torch.stack([x == t[16 - n : -n] for n in range(2, 9)]).any(0)
    steps = (x - t[15:-1]) % 97 == (t[15:-1] - t[14:-2]) % 97
    assert (repeats | steps).float().mean() > 0.9


# --- build_data: splits and errors --------------------------------------------------------------------


def test_build_data_splits_off_the_tail_for_eval(tmp_path: Path) -> None:
    path = write_array(tmp_path / "t.bin", "H", list(range(1000)))
    cfg = DataConfig(source="tokens", path=str(path), eval_fraction=0.1)
    train, held = build_data(cfg, seq_length=8, vocab_size=1000, seed=0)
    assert (len(train), len(held)) == (900, 100) and (train.split, held.split) == ("train", "eval")
    assert train.tokens.tolist() + held.tokens.tolist() == list(range(1000)) and held.offset == 900
    assert train.fingerprint == held.fingerprint == fingerprint(load_tokens(str(path)).tokens)
    line = train.describe()
    assert line.startswith("tokens/train: 900 tokens (uint16) ") and str(path) in line
    assert f"sha256:{train.fingerprint.sha256[:12]}" in line
    # eval_fraction 0 still holds out one sequence plus its target
    cfg = DataConfig(source="tokens", path=str(path), eval_fraction=0.0)
    _, held = build_data(cfg, seq_length=8, vocab_size=1000, seed=0)
    assert len(held) == 9


def test_build_data_synthetic_and_corpus_defaults(tmp_path: Path) -> None:
    train, held = build_data(DataConfig(source="synthetic"), seq_length=32, vocab_size=64, seed=1)
    assert train.source == "synthetic" and int(train.tokens.max()) < 64 and len(held) >= 33
    train, _ = build_data(DataConfig(), seq_length=128, vocab_size=256, seed=1, cache_dir=tmp_path)
    assert train.source == "corpus"


def test_token_id_over_vocab_names_the_max_id_and_the_fix(tmp_path: Path) -> None:
    path = write_array(tmp_path / "big.bin", "H", IDS * 10)
    with pytest.raises(DataError, match=r"big\.bin: token id 65535 does not fit model.vocab_size=50304") as err:
        build_data(DataConfig(source="tokens", path=str(path)), seq_length=4, vocab_size=50304, seed=0)
    assert "model.vocab_size to at least 65536" in (err.value.fix or "")
    with pytest.raises(DataError, match="vocab_size=200"):
        build_data(DataConfig(), seq_length=4, vocab_size=200, seed=0, cache_dir=tmp_path)  # bytes need 256


def test_too_short_and_missing_files_are_errors_naming_the_file(tmp_path: Path) -> None:
    path = write_array(tmp_path / "short.bin", "H", list(range(20)))
    with pytest.raises(DataError, match=r"short\.bin: 20 tokens is too short .* model.seq_length=16"):
        build_data(DataConfig(source="tokens", path=str(path)), seq_length=16, vocab_size=100, seed=0)
    for source, name in [("tokens", "gone.bin"), ("text", "gone.txt"), ("megatron", "gone")]:
        with pytest.raises(DataError, match=name):
            build_data(DataConfig(source=source, path=str(tmp_path / name)), seq_length=4, vocab_size=256, seed=0)
    with pytest.raises(DataError, match="data.source=tokens needs data.path"):
        load_source(DataConfig(source="tokens"), vocab_size=256, seed=0)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.txt: no tokens"):
        load_text(str(empty))


def test_errors_print_as_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        load_tokens(str(tmp_path / "gone.bin"))
    assert "\n" not in err.value.one_line() and "fix:" in err.value.one_line()


@pytest.mark.parametrize("source", ["tokens", "text"])
def test_a_folder_given_as_data_path_is_named_a_folder(tmp_path: Path, source: str) -> None:
    """It said 'no such file' about a folder that exists; a missing path still says that."""
    from trainer.data.sources.text import load_text
    from trainer.data.storage import map_file

    def load(path: str) -> object:
        return map_file(path, torch.uint16) if source == "tokens" else load_text(path)

    with pytest.raises(DataError, match="a folder, not a data file"):
        load(str(tmp_path))
    with pytest.raises(DataError, match="no such file"):
        load(str(tmp_path / "missing.txt"))
