"""`build_data`: the one entry point from `cfg.data` to the train and held-out eval streams."""

from __future__ import annotations

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


def load_source(
    cfg: DataConfig, *, vocab_size: int, seed: int, cache_dir: str | Path | None = "default"
) -> TokenStream:
    """The full (unsplit) stream that `cfg` names; `DataError` when it cannot be read."""
    if cfg.source in _NEEDS_PATH and not cfg.path:
        raise DataError(f"data.source={cfg.source} needs data.path", f"set data.path to {_NEEDS_PATH[cfg.source]}")
    if cfg.tokenizer and cfg.source != "text":
        raise DataError(
            f"data.tokenizer is set but data.source={cfg.source} is already tokenised",
            "remove data.tokenizer, or use data.source: text",
        )
    if cfg.source == "synthetic":
        return build_synthetic(vocab_size=vocab_size, seed=seed)
    if cfg.source == "corpus":
        return build_corpus(cache_dir=cache_dir)
    assert cfg.path is not None
    path = str(Path(cfg.path).expanduser())
    if cfg.source == "tokens":
        return load_tokens(path)
    if cfg.source == "megatron":
        return load_megatron(path)
    if cfg.source == "text":
        return load_text(path, str(Path(cfg.tokenizer).expanduser()) if cfg.tokenizer else None)
    raise DataError(
        f"data.source={cfg.source!r} is not a known source", "use corpus, synthetic, tokens, megatron or text"
    )


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
        `(train, eval)`: two non-overlapping `TokenStream`s; eval is the last `cfg.eval_fraction` of the
        stream (at least seq_length + 1 tokens).
    """
    stream = load_source(cfg, vocab_size=vocab_size, seed=seed, cache_dir=cache_dir)
    check_vocab(stream, vocab_size)
    return split_stream(stream, eval_fraction=cfg.eval_fraction, seq_length=seq_length)
