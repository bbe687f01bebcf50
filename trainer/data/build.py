"""`build_data`: the one entry point from `cfg.data` to the train and held-out eval streams."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from moectl.core.config.schema import DataConfig
from moectl.core.errors import DataError

from .sources import build_corpus, build_synthetic, load_megatron, load_text, load_tokens
from .stream import TokenStream, check_vocab, split_stream

_NEEDS_PATH = {
    "tokens": "a flat token .bin file",
    "megatron": "a Megatron prefix (<prefix>.bin + <prefix>.idx)",
    "text": "a .txt or .jsonl file",
}
_READS_DTYPE = ("tokens", "megatron")


def _check_keys(cfg: DataConfig) -> None:
    """Keys that only some sources read: set for another source, they would be silently ignored."""
    if cfg.source in _NEEDS_PATH and not cfg.path:
        raise DataError(f"data.source={cfg.source} needs data.path", f"set data.path to {_NEEDS_PATH[cfg.source]}")
    if cfg.tokenizer and cfg.source != "text":
        raise DataError(
            f"data.tokenizer is set but data.source={cfg.source} is already tokenised",
            "remove data.tokenizer, or use data.source: text",
        )
    if cfg.dtype is not None and cfg.source not in _READS_DTYPE:
        raise DataError(
            f"data.dtype={cfg.dtype} is set but data.source={cfg.source} decides its own dtype",
            "remove data.dtype (it is for the tokens and megatron sources)",
        )
    for key, value in (("data.path", cfg.path), ("data.eval_path", cfg.eval_path)):
        if value and cfg.source not in _NEEDS_PATH:  # a run believed to train on that file would not
            raise DataError(
                f"{key} is set but data.source={cfg.source} reads no files",
                f"remove {key}, or use a tokens, megatron or text source",
            )


def load_source(
    cfg: DataConfig,
    *,
    vocab_size: int,
    seed: int,
    cache_dir: str | Path | None = "default",
    path: str | None = None,
) -> TokenStream:
    """The full (unsplit) stream that `cfg` names (or file `path` of its source); `DataError` when unreadable."""
    _check_keys(cfg)
    if cfg.source == "synthetic":
        return build_synthetic(vocab_size=vocab_size, seed=seed)
    if cfg.source == "corpus":
        return build_corpus(cache_dir=cache_dir)
    where = path or cfg.path
    assert where is not None
    where = str(Path(where).expanduser())
    if cfg.source == "tokens":
        return load_tokens(where, cfg.dtype)
    if cfg.source == "megatron":
        return load_megatron(where, cfg.dtype)
    if cfg.source == "text":
        return load_text(where, str(Path(cfg.tokenizer).expanduser()) if cfg.tokenizer else None)
    raise DataError(
        f"data.source={cfg.source!r} is not a known source", "use corpus, synthetic, tokens, megatron or text"
    )


def _whole(stream: TokenStream, split: str, seq_length: int, key: str) -> TokenStream:
    """All of `stream` as one split; it must hold one window of seq_length + 1 tokens."""
    if len(stream) < seq_length + 1:
        raise DataError(
            f"{stream.where} ({key}): {len(stream):,} tokens, fewer than one sequence of "
            f"model.seq_length={seq_length} plus its target",
            f"use a longer {key} file or a smaller model.seq_length",
        )
    return replace(stream, split=split)


def build_data(
    cfg: DataConfig, *, seq_length: int, vocab_size: int, seed: int, cache_dir: str | Path | None = "default"
) -> tuple[TokenStream, TokenStream]:
    """Load the configured source, check every id fits `vocab_size`, and split off held-out eval data.

    Args:
        cfg: the `data` section.
        seq_length: `model.seq_length`; each split must hold at least one window of seq_length + 1.
        vocab_size: `model.vocab_size`; a larger token id is a `DataError`.
        seed: `train.seed`; only the synthetic source uses it (to generate its tokens).
        cache_dir: where the corpus source caches its built stream ("default": see sources/corpus.py).

    Returns:
        `(train, eval)`: two non-overlapping `TokenStream`s. With `cfg.eval_path` set, train is all of
        `cfg.path` and eval all of `cfg.eval_path` (read by the same source, dtype and tokenizer); otherwise
        eval is the last `cfg.eval_fraction` of the stream (at least seq_length + 1 tokens).
    """
    stream = load_source(cfg, vocab_size=vocab_size, seed=seed, cache_dir=cache_dir)
    check_vocab(stream, vocab_size)
    if not cfg.eval_path:
        return split_stream(stream, eval_fraction=cfg.eval_fraction, seq_length=seq_length)
    try:
        held = load_source(cfg, vocab_size=vocab_size, seed=seed, cache_dir=cache_dir, path=cfg.eval_path)
        check_vocab(held, vocab_size)
    except DataError as e:  # the source's checks speak of data.path; this file came from data.eval_path
        fix = (e.fix or "").replace("data.path", "data.eval_path") or None
        raise DataError(f"data.eval_path: {e.message}", fix) from None
    return _whole(stream, "train", seq_length, "data.path"), _whole(held, "eval", seq_length, "data.eval_path")
