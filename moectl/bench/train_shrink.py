"""`bench train --quick`: the config's structure, shrunk to a model that runs a step in well under a second
on a CPU (the CI smoke test of the whole bench path).

Kept: layer pattern (dense/MoE, on the first layers), GQA (queries per group, where it divides), QK norm,
router (score function, top-k normalisation, aux losses), activation, expert backend and layout, precision
recipe, optimizer, parallel settings, data source. Shrunk: depth, widths (head dim: hidden / heads), vocabulary, sequence, experts and
top-k, batch (2 micro-batches per rank). The device becomes the CPU.
"""

from __future__ import annotations

from moectl.core.config.schema import Config

LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQ = 2, 64, 4, 128, 256, 64
EXPERTS, EXPERT_FFN, MICRO_BATCH = 8, 32, 2


def quick_overrides(cfg: Config, world_size: int = 1) -> list[str]:
    """`--set` overrides that shrink `cfg` for `bench train --quick` on `world_size` processes."""
    m, moe = cfg.model, cfg.moe
    layers = min(m.num_layers, LAYERS)
    per_group = max(m.num_attention_heads // m.kv_heads, 1)
    groups = max(HEADS // per_group, 1) if HEADS % per_group == 0 else HEADS
    experts = min(moe.num_experts, EXPERTS)
    ep = cfg.parallel.expert_model_parallel_size
    experts = max(experts // ep, 1) * ep  # still divisible over expert parallelism
    topk = max(1, min(moe.router_topk, experts // 2))
    freq = m.moe_layer_freq
    if isinstance(freq, list):
        kept = [int(bool(x)) for x in freq[:layers]]
        kept[-1] = 1 if not any(kept) else kept[-1]  # keep at least one MoE layer
        pattern = f"[{','.join(map(str, kept))}]"
    else:
        pattern = str(min(freq, layers))
    return [
        f"model.num_layers={layers}", f"model.hidden_size={HIDDEN}", f"model.num_attention_heads={HEADS}",
        f"model.num_query_groups={groups}", "model.kv_channels=null", f"model.ffn_hidden_size={FFN}",
        f"model.vocab_size={min(m.vocab_size, VOCAB)}", f"model.seq_length={min(m.seq_length, SEQ)}",
        f"model.moe_layer_freq={pattern}", f"moe.num_experts={experts}", f"moe.router_topk={topk}",
        f"moe.ffn_hidden_size={EXPERT_FFN}", "moe.glu_interleave_size=null",
        f"train.micro_batch_size={MICRO_BATCH}", f"train.global_batch_size={2 * MICRO_BATCH * world_size}",
        "train.device=cpu", "parallel.bucket_size=null",
    ]  # fmt: skip
