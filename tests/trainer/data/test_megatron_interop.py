"""moectl reads Megatron-Core's indexed datasets token for token, and refuses every pair that does not belong.

The datasets are `megatron_reference.CASES`. Three witnesses agree on them: files Megatron-Core 0.16.1's own
`IndexedDatasetBuilder` wrote (committed in fixtures/megatron/, with what Megatron's `IndexedDataset` read
back), `megatron_writer.Builder` (byte for byte the same files, for machines without Megatron-Core), and,
where Megatron-Core imports, the builder and reader run live in a subprocess.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
import torch

from megatron_reference import CASES, TEXT, build, expected_tokens
from megatron_writer import Builder
from moectl.core.config.schema import DataConfig
from moectl.core.errors import DataError
from trainer.data import build_data
from trainer.data.sources import load_megatron

HERE = Path(__file__).parent
FIXTURE = HERE / "fixtures" / "megatron"
DTYPES = {"uint16": torch.uint16, "int32": torch.int32, "uint8": torch.uint8}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case, written by moectl's test writer."""
    out = tmp_path_factory.mktemp("writer")
    build(out, Builder, lambda ids, dtype: ids)
    return out


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case built and read back by Megatron-Core itself (a subprocess: its import has global effects)."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed (the committed fixture stands in for it)")
    out = tmp_path_factory.mktemp("megatron_core")
    subprocess.run([sys.executable, str(HERE / "megatron_reference.py"), str(out)], check=True,
                   capture_output=True, timeout=300)
    return out


def megatron_read(folder: Path, name: str) -> list[int]:
    """What Megatron-Core's `IndexedDataset` returned for dataset `name` (all sequences, concatenated)."""
    return array("q", (folder / f"{name}.tokens").read_bytes()).tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_writer_is_byte_identical_to_megatron_cores_builder(written: Path, name: str) -> None:
    for ext in (".bin", ".idx"):
        assert (written / f"{name}{ext}").read_bytes() == (FIXTURE / f"{name}{ext}").read_bytes(), ext


@pytest.mark.parametrize("name", list(CASES))
def test_moectl_reads_what_megatron_reads(name: str) -> None:
    stream = load_megatron(str(FIXTURE / name))
    assert stream.tokens.dtype == DTYPES[CASES[name][0]]
    assert stream.tokens.tolist() == megatron_read(FIXTURE, name) == expected_tokens(name)


@pytest.mark.parametrize("name", list(CASES))
def test_live_megatron_core_builder_and_reader_agree(live: Path, name: str) -> None:
    for ext in (".bin", ".idx"):  # the installed release still writes the committed format
        assert (live / f"{name}{ext}").read_bytes() == (FIXTURE / f"{name}{ext}").read_bytes(), ext
    assert load_megatron(str(live / name)).tokens.tolist() == megatron_read(live, name) == expected_tokens(name)


def test_merged_index_keeps_documents(written: Path) -> None:
    stream = load_megatron(str(written / "u16_merged"))
    assert stream.notes == {"sequences": 6 + 1 + 1, "documents": 3 + 1 + 1}


# --- pairs that do not belong together ------------------------------------------------------------------


def pair(tmp_path: Path, idx_from: str, bin_from: str) -> Path:
    """A prefix whose .idx is one dataset's and whose .bin is another's."""
    shutil.copy(FIXTURE / f"{idx_from}.idx", tmp_path / "mixed.idx")
    shutil.copy(FIXTURE / f"{bin_from}.bin", tmp_path / "mixed.bin")
    return tmp_path / "mixed"


def same_ids(tmp_path: Path, dtype: str) -> Path:
    """TEXT's ids, one document, written as `dtype` (so datasets of different dtypes have the same index)."""
    b = Builder(tmp_path / f"{dtype}.bin", dtype)
    b.add_item(TEXT * 4)
    b.end_document()
    b.finalize(tmp_path / f"{dtype}.idx")
    return tmp_path / dtype


@pytest.mark.parametrize(
    "index_dtype,bin_dtype,says",
    [
        ("uint8", "uint16", r"exactly 2x, as when the \.bin holds uint16 tokens under an index that says uint8"),
        ("uint16", "int32", r"exactly 2x, as when the \.bin holds int32 or uint32 tokens .* says uint16"),
        ("uint8", "int32", r"exactly 4x, as when the \.bin holds int32 or uint32 tokens .* says uint8"),
        ("int32", "uint16", r"exactly 2x, as when the \.bin holds uint16 tokens under an index that says int32"),
    ],
)
def test_an_index_whose_dtype_does_not_match_its_bin_is_refused(
    tmp_path: Path, index_dtype: str, bin_dtype: str, says: str
) -> None:
    n = len(TEXT) * 4
    shutil.copy(f"{same_ids(tmp_path, index_dtype)}.idx", tmp_path / "m.idx")
    shutil.copy(f"{same_ids(tmp_path, bin_dtype)}.bin", tmp_path / "m.bin")
    width = {"uint8": 1, "uint16": 2, "int32": 4}
    sizes = rf"{n * width[bin_dtype]:,} bytes, but m\.idx accounts for {n:,} {index_dtype} tokens = {n * width[index_dtype]:,}"
    with pytest.raises(DataError, match=sizes + r" bytes: the sizes differ by " + says):
        load_megatron(str(tmp_path / "m"))


def test_trailing_bytes_and_truncation_name_both_sizes(tmp_path: Path) -> None:
    prefix = pair(tmp_path, "u16_docs", "u16_docs")
    size = (FIXTURE / "u16_docs.bin").stat().st_size
    with open(f"{prefix}.bin", "ab") as f:
        f.write(b"\x07" * 4000)
    with pytest.raises(DataError, match=rf"mixed\.bin: {size + 4000:,} bytes, .* = {size} bytes \(4,000 bytes extra\)"):
        load_megatron(str(prefix))
    Path(f"{prefix}.bin").write_bytes((FIXTURE / "u16_docs.bin").read_bytes()[:-6])
    with pytest.raises(DataError, match=rf"{size - 6} bytes, .* = {size} bytes \(6 bytes missing\)") as err:
        load_megatron(str(prefix))
    assert "truncated" in (err.value.fix or "")
    # a .bin from another dataset of the same dtype
    with pytest.raises(DataError, match="u16_tail|bytes missing"):
        load_megatron(str(pair(tmp_path, "u16_docs", "u16_tail")))


def test_right_sizes_but_wrong_dtype_is_caught_by_the_zeros(tmp_path: Path) -> None:
    # int32 ids pushed through a uint16 builder (2 values per id): sizes agree, every other value is 0.
    ids = list(range(100, 700))
    as_u16 = array("H", array("i", ids).tobytes()).tolist()
    b = Builder(tmp_path / "w.bin", "uint16")
    b.add_item(as_u16)
    b.end_document()
    b.finalize(tmp_path / "w.idx")
    with pytest.raises(DataError, match=r"w\.bin: read as uint16 \(the dtype w\.idx names\).*holds uint32 tokens"):
        load_megatron(str(tmp_path / "w"))


def test_a_truncated_index_says_truncated_not_bad_magic(tmp_path: Path) -> None:
    raw = (FIXTURE / "u16_docs.idx").read_bytes()
    shutil.copy(FIXTURE / "u16_docs.bin", tmp_path / "t.bin")
    for keep, says in [(20, r"truncated \(20 bytes, shorter than the 34-byte header\)"), (5, r"truncated \(5 bytes"),
                       (60, r"truncated \(60 bytes, the header promises 138")]:
        (tmp_path / "t.idx").write_bytes(raw[:keep])
        with pytest.raises(DataError, match=r"t\.idx: " + says):
            load_megatron(str(tmp_path / "t"))
    (tmp_path / "t.idx").write_bytes(raw + b"\x00" * 3)
    with pytest.raises(DataError, match=r"t\.idx: 141 bytes, but the header accounts for 138 .* 3 bytes too many"):
        load_megatron(str(tmp_path / "t"))
    (tmp_path / "t.idx").write_bytes(b"TNTIDX\x00\x00\x00" + raw[9:])
    with pytest.raises(DataError, match=r"t\.idx: not a Megatron index \(bad magic"):
        load_megatron(str(tmp_path / "t"))


def test_data_dtype_must_match_the_index() -> None:
    assert load_megatron(str(FIXTURE / "i32_docs"), "int32").tokens.dtype == torch.int32
    with pytest.raises(DataError, match=r"i32_docs\.idx: the index says int32 tokens but data.dtype=uint32") as err:
        load_megatron(str(FIXTURE / "i32_docs"), "uint32")
    assert "data.dtype: int32" in (err.value.fix or "")


def test_a_second_prefix_is_the_eval_set() -> None:
    cfg = DataConfig(source="megatron", path=str(FIXTURE / "u16_docs"), eval_path=str(FIXTURE / "u16_tail"))
    train, held = build_data(cfg, seq_length=8, vocab_size=65536, seed=0)
    assert train.tokens.tolist() == expected_tokens("u16_docs") and held.tokens.tolist() == expected_tokens("u16_tail")
    assert (train.split, held.split) == ("train", "eval") and held.path == str(FIXTURE / "u16_tail.bin")
