"""The run summary `validate-config` prints: world layout, parameter counts, per-rank memory estimate.

Pure arithmetic on the config: no model is built and torch is not imported. The counts are the one
parameter counter's (`moectl/core/params.py`).

Memory is per rank and leaves out activations, temporary quantized copies and communication buffers:
- weights: bf16 (2 bytes) or fp32 (4); with low-precision param gather the GEMM weights (attention,
  dense MLP, experts) are stored quantized with a rowwise and a columnwise plane (fp8: 1 byte each plus
  scales; nvfp4: half a byte plus one fp8 scale per 16), and MXFP8 gather without the reuse buffer adds
  a bf16 staging copy; embeddings, norms, router and biases stay in the model dtype.
- grads: one grad buffer for all local params, fp32 when `grad_reduce_in_fp32`, else the model dtype.
- fp32 masters (only when params are not fp32) and optimizer state (Adam: 2 fp32 moments; Muon: one
  fp32 momentum for matrices and Adam for the rest; SGD: none), divided over the data-parallel ranks
  for dense params and over the expert-data-parallel ranks (dp / ep) for expert params when the
  distributed optimizer is on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from moectl.core.config.schema import Config
from moectl.core.overlap import describe_overlap
from moectl.core.params import count_params

# Bytes per element of a quantized weight, both planes (rowwise for forward, columnwise for backward).
QUANTIZED_WEIGHT_BYTES = {
    "tensorwise": 2.0,
    "delayed": 2.0,
    "rowwise": 2.0,
    "blockwise": 2.0,
    "mxfp8": 2 * (1 + 1 / 32),  # one e8m0 scale per 32 values
    "nvfp4": 2 * (0.5 + 1 / 16),  # one e4m3 scale per 16 values
}


@dataclass(frozen=True)
class Layout:
    """How ranks are arranged: dp = world size; experts sharded over ep, replicated over dp / ep."""

    world_size: int
    dp: int
    ep: int
    expert_dp: int
    experts_per_rank: int


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of the whole model, by kind (experts counted over all E)."""

    embedding: int  # word embeddings plus the untied output head
    attention: int  # QKV and output projections
    dense_mlp: int
    router: int
    experts: int  # expert weights and biases
    norms: int
    total: int
    active: int  # per token: only top-k of E experts
    per_rank: int  # everything except experts, plus this rank's E / ep experts


@dataclass(frozen=True)
class Memory:
    """Estimated bytes per rank (no activations)."""

    weights: int
    grads: int
    masters: int
    optimizer: int
    total: int
    weight_storage: str
    grad_dtype: str
    sharded_over: str


@dataclass(frozen=True)
class RunSummary:
    """Layout, parameter counts and memory estimate of a resolved config."""

    layout: Layout
    params: ParamCounts
    memory: Memory

    def to_json(self) -> dict[str, Any]:
        """Plain data for `--json`."""
        return asdict(self)


@dataclass(frozen=True)
class _Groups:
    """Parameter counts split the way storage and optimizers treat them."""

    gemm: int  # quantizable matrices outside the experts (attention, dense MLP)
    router: int
    embedding: int
    vectors: int  # norms
    expert_gemm: int
    expert_bias: int


def _groups(cfg: Config) -> _Groups:
    p = count_params(cfg.model, cfg.moe)
    return _Groups(
        gemm=p.attention + p.dense_mlp,
        router=p.router,
        embedding=p.embedding + p.output_head,
        vectors=p.norms,
        expert_gemm=p.expert_weights,
        expert_bias=p.expert_biases,
    )


def layout(cfg: Config, world_size: int) -> Layout:
    """The world layout; raises ValueError when the sizes do not divide (the rules say which)."""
    ep, e = cfg.parallel.expert_model_parallel_size, cfg.moe.num_experts
    if world_size < 1 or ep < 1 or world_size % ep or e < 1 or e % ep:
        raise ValueError("world size, expert_model_parallel_size and num_experts do not fit together")
    return Layout(world_size=world_size, dp=world_size, ep=ep, expert_dp=world_size // ep, experts_per_rank=e // ep)


def param_counts(cfg: Config, world_size: int) -> ParamCounts:
    """Total, active-per-token and per-rank parameter counts."""
    p = count_params(cfg.model, cfg.moe)
    lay = layout(cfg, world_size)
    return ParamCounts(
        embedding=p.embedding + p.output_head,
        attention=p.attention,
        dense_mlp=p.dense_mlp,
        router=p.router,
        experts=p.experts,
        norms=p.norms,
        total=p.total,
        active=p.active,
        per_rank=p.total - p.experts + p.experts // lay.ep,
    )


def memory(cfg: Config, world_size: int) -> Memory:
    """Per-rank bytes of weights, grads, fp32 masters and optimizer state."""
    g = _groups(cfg)
    lay = layout(cfg, world_size)
    mp, par, opt = cfg.mixed_precision, cfg.parallel, cfg.optimizer
    hp = 2 if mp.bf16 else 4
    lp_recipe = (
        mp.fp8_recipe
        if (mp.fp8 and mp.fp8_param_gather)
        else (mp.fp4_recipe if (mp.fp4 and mp.fp4_param_gather) else None)
    )
    q_bytes = QUANTIZED_WEIGHT_BYTES[lp_recipe] if lp_recipe else hp
    staging = 2 if lp_recipe == "mxfp8" and not mp.reuse_grad_buf_for_mxfp8_param_ag else 0

    local_gemm = g.gemm + g.expert_gemm / lay.ep
    local_other = g.router + g.embedding + g.vectors + g.expert_bias / lay.ep
    local = local_gemm + local_other
    weights = local_gemm * (q_bytes + staging) + local_other * hp

    grad_bytes = 4 if par.grad_reduce_in_fp32 else hp
    grads = local * grad_bytes

    # What one rank keeps of the optimizer's per-param state: dense over dp, experts over dp / ep.
    dense_share = 1 / lay.dp if par.use_distributed_optimizer else 1.0
    expert_share = 1 / lay.expert_dp if par.use_distributed_optimizer else 1.0
    dense_gemm, dense_other = g.gemm + g.router, g.embedding + g.vectors
    expert_gemm, expert_other = g.expert_gemm / lay.ep, g.expert_bias / lay.ep

    def sharded(matrix_bytes: float, other_bytes: float) -> float:
        return (dense_gemm * matrix_bytes + dense_other * other_bytes) * dense_share + (
            expert_gemm * matrix_bytes + expert_other * other_bytes
        ) * expert_share

    params_fp32 = not mp.bf16 and lp_recipe is None
    masters = 0.0 if params_fp32 else sharded(4, 4)
    if opt.optimizer == "adam":
        state = sharded(8, 8)
    elif opt.optimizer == "muon":  # matrices (router included) take Muon's momentum, the rest Adam's moments
        state = sharded(4, 8)
    else:
        state = 0.0
    storage = f"{lp_recipe} (+bf16 staging)" if staging else (lp_recipe or ("bf16" if mp.bf16 else "fp32"))
    return Memory(
        weights=int(weights),
        grads=int(grads),
        masters=int(masters),
        optimizer=int(state),
        total=int(weights) + int(grads) + int(masters) + int(state),
        weight_storage=storage,
        grad_dtype="fp32" if grad_bytes == 4 else "bf16",
        sharded_over=(
            f"dp {lay.dp}, experts over expert-dp {lay.expert_dp}" if par.use_distributed_optimizer else "not sharded"
        ),
    )


def summarize(cfg: Config, world_size: int) -> RunSummary:
    """The whole summary; raises ValueError when the sizes make it meaningless (the rules report why)."""
    m = cfg.model
    if min(m.num_layers, m.hidden_size, m.num_attention_heads, m.vocab_size, cfg.moe.num_experts) < 1:
        raise ValueError("model sizes must be positive")
    if max(m.num_layers, m.hidden_size, m.vocab_size, m.seq_length, cfg.moe.num_experts, cfg.moe.ffn_hidden_size,
           cfg.train.micro_batch_size) > 2**63 - 1:  # MOE075 refuses it; floats of the counts would overflow
        raise ValueError("model sizes must fit 64 bits")
    if isinstance(m.moe_layer_freq, list) and len(m.moe_layer_freq) != m.num_layers:
        raise ValueError("moe_layer_freq does not fit num_layers")
    if not isinstance(m.moe_layer_freq, list) and m.moe_layer_freq < 1:
        raise ValueError("moe_layer_freq must be >= 1")
    if not 1 <= cfg.moe.router_topk <= cfg.moe.num_experts:  # MOE018; "279K active of 156K" would say nothing
        raise ValueError("router_topk must be within 1..num_experts")
    return RunSummary(layout(cfg, world_size), param_counts(cfg, world_size), memory(cfg, world_size))


def human_count(n: float) -> str:
    """1234567 -> '1.23M'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def human_bytes(n: float) -> str:
    """Bytes in binary units: '1.5 GiB'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def summary_lines(s: RunSummary, cfg: Config) -> list[tuple[str, str]]:
    """(label, text) rows for the human summary."""
    lay, p, mem = s.layout, s.params, s.memory
    ranks = "rank" if lay.world_size == 1 else "ranks"
    return [
        (
            "world",
            f"{lay.world_size} {ranks}: dp {lay.dp}, ep {lay.ep}, expert-dp {lay.expert_dp} "
            f"({lay.experts_per_rank} of {cfg.moe.num_experts} experts per rank); overlap: "
            + describe_overlap(cfg.parallel, lay.dp),
        ),
        (
            "params",
            f"{human_count(p.total)} total, {human_count(p.active)} active per token "
            f"(top-{cfg.moe.router_topk} of {cfg.moe.num_experts} experts), {human_count(p.per_rank)} per rank",
        ),
        (
            "memory",
            f"{human_bytes(mem.total)} per rank without activations: weights {human_bytes(mem.weights)} "
            f"({mem.weight_storage}), grads {human_bytes(mem.grads)} ({mem.grad_dtype}), fp32 masters "
            f"{human_bytes(mem.masters)}, {cfg.optimizer.optimizer} state {human_bytes(mem.optimizer)} "
            f"(sharded: {mem.sharded_over})",
        ),
    ]
