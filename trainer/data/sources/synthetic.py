"""`synthetic`: a deterministic, learnable token stream for tests and smoke runs (no file).

The stream is a sequence of segments, 32..256 tokens each. Each segment is one of two patterns, picked at
random:
  - a repeating n-gram (n in 2..8): random tokens, tiled; once one period is seen, the rest is predictable;
  - an arithmetic sequence `a + d*i (mod vocab)` with d in 1..7: predictable from the last two tokens.
A small model's loss therefore falls well below log(vocab) within a few hundred steps. Everything is drawn
from one CPU `torch.Generator` seeded with `seed` (the run's train.seed), so the stream is a pure function
of (vocab_size, seed, num_tokens) for a given torch version; torch does not promise its random streams
across releases, which is why the stream's sha256 is logged with every run.
"""

from __future__ import annotations

import torch

from ..stream import TokenStream

#: Default length: 1 Mi tokens, enough for thousands of distinct windows, built in well under a second.
DEFAULT_TOKENS = 1 << 20


def build_synthetic(*, vocab_size: int, seed: int, num_tokens: int = DEFAULT_TOKENS) -> TokenStream:
    """Build the synthetic stream (int32 ids in [0, vocab_size))."""
    if vocab_size < 2:
        raise ValueError("synthetic data needs vocab_size >= 2")
    g = torch.Generator().manual_seed(seed)
    # Draw every segment's parameters at once (vectorised: a Python loop over ~8k segments is too slow
    # for a test suite on a 2-core machine). Segments are at least 32 long, so this many always suffice.
    n_seg = num_tokens // 32 + 1
    length_S = torch.randint(32, 257, (n_seg,), generator=g)
    is_ngram_S = torch.randint(0, 2, (n_seg,), generator=g).bool()
    n_S = torch.randint(2, 9, (n_seg,), generator=g)
    gram_S8 = torch.randint(0, vocab_size, (n_seg, 8), generator=g)
    a_S = torch.randint(0, vocab_size, (n_seg,), generator=g)
    d_S = torch.randint(1, 8, (n_seg,), generator=g)

    end_S = torch.cumsum(length_S, 0)
    pos_T = torch.arange(num_tokens)
    seg_T = torch.searchsorted(end_S, pos_T, right=True)  # segment of each position
    i_T = pos_T - (end_S[seg_T] - length_S[seg_T])  # position inside its segment
    ngram_T = gram_S8[seg_T, i_T % n_S[seg_T]]
    arith_T = (a_S[seg_T] + d_S[seg_T] * i_T) % vocab_size
    out = torch.where(is_ngram_S[seg_T], ngram_T, arith_T).to(torch.int32)
    return TokenStream(source="synthetic", tokens=out, notes={"seed": seed})
