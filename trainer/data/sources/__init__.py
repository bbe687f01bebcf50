"""Token sources: each turns a `DataConfig` into one flat `TokenStream` (see each module's docstring)."""

from __future__ import annotations

from .corpus import build_corpus
from .megatron import load_megatron
from .megatron_index import read_index
from .synthetic import build_synthetic
from .text import load_text
from .tokens import load_tokens

__all__ = ["build_corpus", "build_synthetic", "load_megatron", "load_text", "load_tokens", "read_index"]
