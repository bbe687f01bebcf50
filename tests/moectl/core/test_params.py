"""The one parameter counter (moectl/core/params.py) against `sum(p.numel())` of models actually built.

Every shipped config is built: the small ones as they are, the large ones (up to 47B parameters, too big
to initialise on a CI CPU) as a miniature that keeps every structural key - layer count, MoE layer
pattern, query-group ratio, tied embeddings, QK norm, activation, expert biases, expert count up to 16 -
with small distinct widths, so each term of the count is exercised with its own value.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moectl.core.config.load import load_config
from moectl.core.config.schema import Config
from moectl.core.params import count_params
from moectl.core.summary import param_counts
from trainer.flops import flops_per_token
from trainer.model import GPTMoE

REPO = Path(__file__).resolve().parents[3]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
BUILD_AS_IS = 2e8  # parameters: at most this many, the config itself is built


def miniature(cfg: Config) -> Config:
    m, e = cfg.model, cfg.moe
    heads = 4
    groups = m.num_query_groups and max(1, heads * m.num_query_groups // m.num_attention_heads)
    experts = min(e.num_experts, 16)
    model = dataclasses.replace(m, hidden_size=40, num_attention_heads=heads, num_query_groups=groups,
                                ffn_hidden_size=56, vocab_size=97, seq_length=16)
    moe = dataclasses.replace(e, num_experts=experts, router_topk=min(e.router_topk, experts), ffn_hidden_size=24,
                              glu_interleave_size=None)
    return dataclasses.replace(cfg, model=model, moe=moe)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_counter_equals_a_built_model(path: Path) -> None:
    cfg = load_config(path)
    if count_params(cfg.model, cfg.moe).total > BUILD_AS_IS:
        cfg = miniature(cfg)
    model = GPTMoE(cfg.model, cfg.moe, seed=0)
    counts = count_params(cfg.model, cfg.moe)
    params = dict(model.named_parameters())
    assert counts.total == sum(p.numel() for p in params.values())
    assert counts.experts == sum(p.numel() for n, p in params.items() if ".experts." in n)
    assert counts.router == sum(p.numel() for n, p in params.items() if ".router." in n)
    assert counts.norms == sum(p.numel() for n, p in params.items() if p.dim() == 1 and ".experts." not in n)


def test_summary_and_flops_use_the_counter() -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    counts = count_params(cfg.model, cfg.moe)
    summary = param_counts(cfg, 1)
    assert (summary.total, summary.active, summary.experts) == (counts.total, counts.active, counts.experts)
    m = cfg.model
    # 6 x the active matmul params (output head included, the embedding lookup not) + attention scores
    head = m.vocab_size * m.hidden_size
    matmul = counts.attention + counts.dense_mlp + counts.router + counts.expert_weights * counts.topk_fraction + head
    assert flops_per_token(cfg.model, cfg.moe) == 6 * matmul + 12 * m.num_layers * m.seq_length * m.hidden_size


def test_active_counts_only_topk_of_the_experts() -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    counts = count_params(cfg.model, cfg.moe)
    k, e = cfg.moe.router_topk, cfg.moe.num_experts
    assert counts.total - counts.active == counts.experts - int(counts.experts * k / e)
    assert counts.active < counts.total
