"""The token-source abstraction: a flat 1-D stream of token ids, and its train / held-out eval split.

Every source (synthetic, corpus, tokens, megatron, text) produces one `TokenStream`. Documents are already
concatenated (with the source's separator, if any), so the sampler only ever cuts windows out of one array.
The tensor keeps its storage dtype (uint8 .. int64, often a memory-mapped file); windows are widened to
int64 only when a batch is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch

from moectl.core.errors import ConfigError, DataError

from .dtype_check import narrower_fits
from .storage import Fingerprint, dtype_name, fingerprint, max_token, min_token


class _LazyFingerprint:
    """Computed once, shared by a stream and its splits (hashing a big file twice would be waste)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self._tokens = tokens

    @cached_property
    def value(self) -> Fingerprint:
        return fingerprint(self._tokens)


@dataclass(frozen=True)
class TokenStream:
    """A flat token stream from one source, or a contiguous split of one.

    Attributes:
        source: the source name (`corpus`, `synthetic`, `tokens`, `megatron`, `text`).
        tokens: 1-D integer tensor, CPU, contiguous, in its storage dtype.
        path: the file (or Megatron prefix) it came from; None for synthetic data.
        split: `all`, `train` or `eval`.
        offset: where this split starts in the full stream, in tokens.
        notes: source-specific facts worth logging (file count, dtype origin, documents ...).
    """

    source: str
    tokens: torch.Tensor
    path: str | None = None
    split: str = "all"
    offset: int = 0
    notes: dict[str, Any] = field(default_factory=dict)
    _fp: _LazyFingerprint | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.tokens.device.type != "cpu" or not self.tokens.is_contiguous():
            raise ValueError("a TokenStream holds a contiguous 1-D CPU tensor")
        if self._fp is None:
            object.__setattr__(self, "_fp", _LazyFingerprint(self.tokens))

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def where(self) -> str:
        """The file a user should look at in an error message."""
        return self.path or f"<{self.source} data>"

    @property
    def fingerprint(self) -> Fingerprint:
        """sha256 of the whole source stream (before the split) in its storage dtype; computed on first use."""
        assert self._fp is not None
        return self._fp.value

    def window(self, start: int, length: int) -> torch.Tensor:
        """Tokens [start, start+length) as int64 (the dtype embeddings and the loss want)."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"window [{start}, {start + length}) outside a stream of {len(self)} tokens")
        return self.tokens[start : start + length].to(torch.int64)

    def meta(self) -> dict[str, Any]:
        """What a run should log about its data (JSON-friendly)."""
        fp = self.fingerprint
        return {
            "source": self.source,
            "split": self.split,
            "path": self.path,
            "tokens": len(self),
            "offset": self.offset,
            "dtype": dtype_name(self.tokens.dtype),
            "sha256": fp.sha256,
            "sha256_full": fp.full,
            **self.notes,
        }

    def describe(self) -> str:
        """One line for the start-up banner: name, split, tokens, dtype, sha256 prefix, path."""
        extra = "".join(f" {k}={v}" for k, v in self.notes.items())
        where = f" {self.path}" if self.path else ""
        return (
            f"{self.source}/{self.split}: {len(self):,} tokens ({dtype_name(self.tokens.dtype)}) "
            f"{self.fingerprint.short()}{where}{extra}"
        )


def check_vocab(stream: TokenStream, vocab_size: int) -> None:
    """Raise `DataError` unless every token id is in [0, vocab_size).

    Skips the scan when the storage dtype cannot hold an out-of-range id (uint8 data with vocab >= 256).
    """
    dtype = stream.tokens.dtype
    unsigned = dtype in (torch.uint8, torch.uint16, torch.uint32)
    bits = torch.empty((), dtype=dtype).element_size() * 8
    if unsigned and vocab_size >= 2**bits:
        return
    top = max_token(stream.tokens)
    if top >= vocab_size:
        raise DataError(
            f"{stream.where}: token id {top} does not fit model.vocab_size={vocab_size}",
            _vocab_fix(stream, top, vocab_size),
        )
    if not unsigned and min_token(stream.tokens) < 0:
        raise DataError(f"{stream.where}: negative token ids in the data", "rebuild the token file")


def _vocab_fix(stream: TokenStream, top: int, vocab_size: int) -> str:
    """What to do about an out-of-vocabulary id: raising the vocabulary is wrong when the dtype is."""
    grow = f"set model.vocab_size to at least {top + 1} if the tokenizer has that many ids"
    origin = stream.notes.get("dtype_from")
    if origin in ("default", "data.dtype"):
        narrower = narrower_fits(stream.tokens, vocab_size)
        if narrower is not None:
            return (
                f"these bytes fit the vocabulary when read as {narrower}: set data.dtype: {narrower} if the file "
                f"holds {narrower} tokens; else {grow}"
            )
    if origin == "default":
        return f"uint16 was assumed (no data.dtype, no suffix): set data.dtype to the file's dtype, or {grow}"
    return f"{grow} (or use data made with a smaller tokenizer)"


def split_stream(stream: TokenStream, *, eval_fraction: float, seq_length: int) -> tuple[TokenStream, TokenStream]:
    """Split off the last `eval_fraction` of the stream as held-out eval data.

    Each side gets at least `seq_length + 1` tokens (one input window plus its last target). The two
    splits do not overlap, so no training window ever sees held-out tokens.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError("data.eval_fraction", eval_fraction, "must be in [0, 1)", "use e.g. 0.05")
    need = seq_length + 1
    n = len(stream)
    if n < 2 * need:
        raise DataError(
            f"{stream.where}: {n:,} tokens is too short for a train and an eval sequence of "
            f"model.seq_length={seq_length} (needs {2 * need:,})",
            "use more data or a smaller model.seq_length",
        )
    n_eval = min(max(math.ceil(eval_fraction * n), need), n - need)
    cut = n - n_eval
    train = replace(stream, tokens=stream.tokens[:cut], split="train", offset=stream.offset)
    held = replace(stream, tokens=stream.tokens[cut:], split="eval", offset=stream.offset + cut)
    return train, held
