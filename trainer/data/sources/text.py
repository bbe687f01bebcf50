"""`text`: a `.txt` file, or a `.jsonl` file with a string field "text" on each line.

Tokenisation:
  - default (`data.tokenizer: null`): bytes. Token id = byte value (vocab 256). A `.txt` file is
    memory-mapped as it is (zero copy), once one pass over it has checked that it is UTF-8 (a file that
    is not is refused, naming the first bad byte). For `.jsonl`, each record's text is UTF-8 encoded and
    records are joined with a NUL byte (id 0), which never occurs in text and so marks document ends the way
    `<|endoftext|>` does for GPT-2.
  - `data.tokenizer: path/to/tokenizer.json`: a local Hugging Face `tokenizers` file, through the
    optional `tokenizers` package (`pip install moectl[tokenizers]`). A `.txt` file is one document;
    `.jsonl` records are separate documents, each followed by the tokenizer's end-of-text token when it
    has one (the first of `END_TOKENS` in its vocabulary), else by nothing.
This source tokenises at start-up, so it suits small and medium files; for large corpora, tokenise once
into a `tokens` or `megatron` file.
"""

from __future__ import annotations

import codecs
import json
import os
from typing import Any

import torch

from moectl.core.errors import DataError

from ..storage import map_file, open_data, require_file
from ..stream import TokenStream

DOC_SEPARATOR_BYTE = 0
END_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


def read_jsonl_texts(path: str) -> list[str]:
    """The "text" field of every non-blank line of a JSON Lines file."""
    texts = []
    with open_data(path, text=True) as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    msg = f"{path}:{lineno}: not valid JSON ({e.msg})"
                    raise DataError(msg, "make each line one JSON object") from None
                text = record.get("text") if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise DataError(f'{path}:{lineno}: no string field "text"', 'give every line a "text" string')
                texts.append(text)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 ({e.reason})", "re-encode the file as UTF-8") from None
    return texts


def load_tokenizer(tokenizer_path: str) -> Any:
    """Load a local tokenizer.json with the optional `tokenizers` package (imported only here)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(
            f"data.tokenizer={tokenizer_path} needs the optional package 'tokenizers', which is not installed",
            "pip install moectl[tokenizers]",
        ) from None
    if not os.path.isfile(tokenizer_path):
        raise DataError(f"{tokenizer_path}: no such tokenizer file", "set data.tokenizer to a local tokenizer.json")
    try:
        return Tokenizer.from_file(tokenizer_path)
    except Exception as e:  # the Rust side raises a bare Exception for a malformed file
        msg = f"{tokenizer_path}: cannot load tokenizer ({e})"
        raise DataError(msg, "give a tokenizer.json saved by the tokenizers library") from None


def _tokenize(texts: list[str], tokenizer: Any) -> tuple[torch.Tensor, str | None]:
    end = next((t for t in END_TOKENS if tokenizer.token_to_id(t) is not None), None)
    suffix = [tokenizer.token_to_id(end)] if end is not None else []
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.extend(suffix)
    return torch.tensor(ids, dtype=torch.int32), end


def _refuse_utf16_or_32(path: str) -> None:
    """A `.txt` read as bytes must be UTF-8: a UTF-16 or UTF-32 file (told by its byte-order mark) would train
    on its encoding's zero bytes, every other token."""
    with open_data(path) as f:
        head = f.read(4)
    for bom, name in ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
                      (b"\xfe\xff", "UTF-16")):  # fmt: skip
        if head.startswith(bom):
            raise DataError(f"{path}: {name} text (its byte-order mark); the byte tokenizer reads UTF-8",
                            f"re-encode the file as UTF-8 (e.g. iconv -f {name} -t UTF-8)")


#: how much of a `.txt` file is decoded at a time when checking it is UTF-8 (bounds the memory of the check)
UTF8_CHUNK = 16 << 20


def _require_utf8(path: str) -> None:
    """A `.txt` read as bytes must be UTF-8, as `.jsonl` and tokenizer input must. Without this check a Latin-1
    or binary file trained without a word on whatever its bytes were (a user trial): one clear refusal naming
    the first bad byte instead. A UTF-16 or UTF-32 file is named by its byte-order mark first."""
    _refuse_utf16_or_32(path)
    decoder = codecs.getincrementaldecoder("utf-8")()
    at = 0
    with open_data(path) as f:
        while True:
            chunk = f.read(UTF8_CHUNK)
            pending = len(decoder.getstate()[0])  # bytes of a character cut by the previous chunk's end
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                where = at - pending + e.start
                raise DataError(
                    f"{path}: not UTF-8 at byte {where:,} ({e.reason}); the text source reads UTF-8 text",
                    "re-encode the file as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8), or, if it holds token ids, "
                    "use data.source: tokens",
                ) from None
            if not chunk:
                return
            at += len(chunk)


def load_text(path: str, tokenizer: str | None = None) -> TokenStream:
    """Tokenise a `.txt` or `.jsonl` file (bytes by default, or a local tokenizer.json)."""
    require_file(path)
    is_jsonl = path.endswith(".jsonl")
    if not is_jsonl and not path.endswith(".txt"):
        raise DataError(f"{path}: the text source reads .txt or .jsonl files", "give a .txt or .jsonl file")
    tok = load_tokenizer(tokenizer) if tokenizer else None
    notes: dict[str, Any] = {"format": "jsonl" if is_jsonl else "txt", "tokenizer": tokenizer or "bytes"}
    if tok is None and not is_jsonl:
        _require_utf8(path)
        tokens = map_file(path, torch.uint8)
    elif tok is None:
        texts = read_jsonl_texts(path)
        data = bytes([DOC_SEPARATOR_BYTE]).join(t.encode("utf-8") for t in texts)
        notes["documents"] = len(texts)
        if not data:
            raise DataError(f"{path}: no text in the file", "point data.path at a non-empty file")
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        if is_jsonl:
            texts = read_jsonl_texts(path)
            notes["documents"] = len(texts)
        else:
            try:
                with open_data(path, text=True) as f:
                    texts = [f.read()]
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 ({e.reason})", "re-encode the file as UTF-8") from None
        tokens, end = _tokenize(texts, tok)
        notes["end_token"] = end
        if tokens.numel() == 0:
            raise DataError(f"{path}: no tokens after tokenisation", "point data.path at a non-empty file")
    return TokenStream(source="text", tokens=tokens, path=path, notes=notes)
