"""The run summary: layout, parameter counts and the per-rank memory estimate, checked by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from moectl.core.config import Config
from moectl.core.config.load import load_config
from moectl.core.summary import human_bytes, human_count, layout, memory, param_counts, summarize, summary_lines

REPO = Path(__file__).resolve().parents[3]

# The defaults with 2 ranks, ep 2. Hand counts (D=64, 4 heads, 4 kv heads, head_dim 16, 2 MoE layers, E=4, F=64):
ATTENTION = 2 * ((4 + 2 * 4) * 16 * 64 + 64 * 64)  # 32768
ROUTER = 2 * 4 * 64  # 512
EMBEDDING = 2 * 256 * 64  # 32768 (untied head)
NORMS = 2 * 2 * 64 + 64  # 320
EXPERTS = 2 * 4 * (2 * 64 * 64 + 64 * 64)  # 98304 (gated fc1 [2F, D] + fc2 [D, F])


def cfg(*sets: str) -> Config:
    return load_config(None, ["parallel.expert_model_parallel_size=2", "mixed_precision.bf16=true", *sets])


def test_param_counts_by_hand() -> None:
    p = param_counts(cfg(), 2)
    assert (p.attention, p.router, p.embedding, p.norms, p.experts, p.dense_mlp) == (
        ATTENTION,
        ROUTER,
        EMBEDDING,
        NORMS,
        EXPERTS,
        0,
    )
    rest = ATTENTION + ROUTER + EMBEDDING + NORMS
    assert p.total == rest + EXPERTS
    assert p.active == rest + EXPERTS * 2 // 4  # top-2 of 4 experts
    assert p.per_rank == rest + EXPERTS // 2  # ep 2: half the experts live here


def test_param_counts_follow_the_options() -> None:
    base = param_counts(cfg(), 2)
    tied = param_counts(cfg("model.tie_embeddings=true"), 2)
    assert base.total - tied.total == 256 * 64
    biased = param_counts(cfg("moe.add_bias=true"), 2)
    assert biased.experts - base.experts == 2 * 4 * (2 * 64 + 64)
    relu = param_counts(cfg("moe.activation=squared_relu"), 2)  # not gated: fc1 is [F, D]
    assert base.experts - relu.experts == 2 * 4 * 64 * 64
    half_dense = param_counts(cfg("model.moe_layer_freq=[1, 0]"), 2)
    assert half_dense.dense_mlp == 3 * 64 * 128 and half_dense.experts == base.experts // 2


def test_mixtral_like_matches_the_published_sizes() -> None:
    p = param_counts(load_config(REPO / "configs" / "mixtral_8x7b_like.yaml"), 64)
    assert p.total == pytest.approx(46.7e9, rel=0.005)  # Mixtral 8x7B: 46.7B total, 12.9B active
    assert p.active == pytest.approx(12.9e9, rel=0.005)


def test_layout() -> None:
    lay = layout(cfg("moe.num_experts=8", "parallel.expert_model_parallel_size=4"), 8)
    assert (lay.world_size, lay.dp, lay.ep, lay.expert_dp, lay.experts_per_rank) == (8, 8, 4, 2, 2)
    with pytest.raises(ValueError):
        layout(cfg(), 3)


def test_memory_by_hand_bf16_adam_distributed() -> None:
    m = memory(cfg(), 2)  # dp 2, ep 2, expert-dp 1
    dense_matrix, dense_other = ATTENTION + ROUTER, EMBEDDING + NORMS
    local = dense_matrix + dense_other + EXPERTS // 2
    assert m.weights == local * 2  # bf16
    assert m.grads == local * 4  # grad_reduce_in_fp32
    # dense state sharded over dp=2, each local expert's state over expert-dp=1
    assert m.masters == (dense_matrix + dense_other) * 4 // 2 + EXPERTS // 2 * 4
    assert m.optimizer == (dense_matrix + dense_other) * 8 // 2 + EXPERTS // 2 * 8
    assert m.total == m.weights + m.grads + m.masters + m.optimizer


def test_memory_follows_precision_and_optimizer() -> None:
    base = memory(cfg(), 2)
    fp32 = memory(cfg("mixed_precision.bf16=false"), 2)
    assert fp32.masters == 0 and fp32.weights == 2 * base.weights  # fp32 params are their own masters
    assert memory(cfg("parallel.grad_reduce_in_fp32=false"), 2).grads == base.grads // 2
    unsharded = memory(cfg("parallel.use_distributed_optimizer=false"), 2)
    assert unsharded.optimizer > base.optimizer and unsharded.sharded_over == "not sharded"
    assert memory(cfg("optimizer.optimizer=sgd"), 2).optimizer == 0
    assert memory(cfg("optimizer.optimizer=muon"), 2).optimizer < base.optimizer  # one moment for matrices

    gemm_local = ATTENTION + EXPERTS // 2
    mx = ["mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=mxfp8", "mixed_precision.fp8_param_gather=true"]
    reuse = memory(cfg(*mx, "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true"), 2)
    staged = memory(cfg(*mx), 2)
    assert staged.weights - reuse.weights == pytest.approx(gemm_local * 2, abs=1)  # the separate bf16 staging
    assert "staging" in staged.weight_storage and reuse.weight_storage == "mxfp8"
    nvfp4 = memory(cfg("mixed_precision.fp4=e2m1", "mixed_precision.fp4_param_gather=true"), 2)
    assert nvfp4.weights < base.weights


def test_summarize_refuses_sizes_the_rules_reject() -> None:
    with pytest.raises(ValueError):
        summarize(cfg("model.num_attention_heads=0"), 2)
    with pytest.raises(ValueError):
        summarize(cfg("model.moe_layer_freq=[1]"), 2)
    # MOE018's: the summary said "279K active per token (top-9 of 4 experts)" of 156K in all
    for topk in (9, 0):
        with pytest.raises(ValueError):
            summarize(cfg(f"moe.router_topk={topk}"), 1)
    # MOE075's: a size torch cannot take is not summarised either
    with pytest.raises(ValueError):
        summarize(cfg("model.num_layers=99999999999999999999"), 1)


def test_human_units() -> None:
    assert human_count(46_702_792_704) == "46.7B" and human_count(999) == "999"
    assert human_bytes(3 * 2**30) == "3 GiB" and human_bytes(512) == "512 B"


@pytest.mark.parametrize(
    ("world", "sets", "want"),
    [
        (1, [], "overlap: grad reduce off, param gather off (null flags: the default at dp=1)"),
        (2, [], "overlap: grad reduce on, param gather on (null flags: the default at dp=2)"),
        (2, ["parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false"],
         "overlap: grad reduce off, param gather off"),
        (2, ["parallel.use_distributed_optimizer=false"], "overlap: grad reduce on, param gather off (null flags: the default at dp=2)"),
    ],
)
def test_the_world_row_says_what_overlaps(world: int, sets: list[str], want: str) -> None:
    c = load_config(None, list(sets))
    rows = dict(summary_lines(summarize(c, world), c))
    assert rows["world"].endswith(want), rows["world"]
