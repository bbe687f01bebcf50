"""Data for training: token sources, the train/eval split, and the deterministic sampler.

    train, held_out = build_data(cfg.data, seq_length=cfg.model.seq_length,
                                 vocab_size=cfg.model.vocab_size, seed=cfg.train.seed)
    print(train.describe()); print(held_out.describe())
    sampler = Sampler(train, seq_length=..., micro_batch_size=..., global_batch_size=...,
                      dp_rank=rank, dp_size=world, seed=cfg.train.seed)
    for x, y in sampler.step_batches(step): ...          # x, y: [B, S] int64
    evals = Sampler(held_out, ...).eval_batches(cfg.train.eval_iters)

Sources (`data.source`): synthetic, corpus (the default: the Python stdlib's source as bytes), tokens
(flat .bin; `data.dtype` or header/suffix, default uint16), megatron (.bin/.idx), text (.txt / .jsonl;
bytes or a local tokenizer.json). Each module under `sources/` documents its format. File sizes must be
exactly what the index, header or dtype accounts for, and `dtype_check.py` refuses bytes that look like a
wider dtype read too narrow. `data.eval_path` names a separate validation file used instead of the
held-out fraction.
"""

from __future__ import annotations

from .build import build_data, load_source
from .sampler import Sampler, splitmix64
from .stream import TokenStream, check_vocab, split_stream

__all__ = ["Sampler", "TokenStream", "build_data", "check_vocab", "load_source", "split_stream", "splitmix64"]
