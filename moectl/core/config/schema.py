"""The typed config: one dataclass per section, every key with its type, default and docstring.

Names follow Megatron-Core where a user would recognise them (docs/interface.md).
Each component receives only its own section (`cfg.moe`, `cfg.parallel`, ...). Cross-field rules do
not live here: they live in `moectl.core.rules`, the one place `validate-config` and `train` both run.
Defaults make `configs/tiny.yaml` train on a CPU in about a minute.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal, Optional, Union

from moectl.core.facts import Activation


def doc(default: Any, help: str) -> Any:
    """A dataclass field with a default and a docstring (shown by `--explain` and in errors)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(kw_only=True)
class ModelConfig:
    """The GPT decoder: sizes, positions, init."""

    num_layers: int = doc(2, "Transformer layers.")
    hidden_size: int = doc(64, "Model width (D).")
    num_attention_heads: int = doc(4, "Query heads.")
    num_query_groups: Optional[int] = doc(None, "Key/value heads for grouped-query attention; null = num_attention_heads.")
    kv_channels: Optional[int] = doc(
        None,
        "Attention head dim (C), Megatron's kv_channels / HF's head_dim; null = hidden_size / num_attention_heads. "
        "Qwen3-30B-A3B has 128 with hidden_size 2048 and 32 heads.",
    )
    ffn_hidden_size: int = doc(128, "Hidden size of the dense SwiGLU MLP on non-MoE layers.")
    vocab_size: int = doc(256, "Vocabulary size; 256 for the byte-level tokenizer.")
    seq_length: int = doc(128, "Tokens per sequence.")
    moe_layer_freq: Union[int, list[int]] = doc(
        1, "Which layers are MoE: an int N makes every N-th layer MoE (1 = all), a list gives 1/0 per layer."
    )
    init_method_std: float = doc(0.02, "Std of the normal init of weight matrices.")
    tie_embeddings: bool = doc(False, "Share the output head with the token embedding.")
    rotary_base: float = doc(10000.0, "RoPE base (theta).")
    qk_layernorm: bool = doc(False, "RMSNorm on queries and keys per head (Qwen3).")
    norm_epsilon: float = doc(1e-5, "RMSNorm epsilon.")

    @property
    def kv_heads(self) -> int:
        """Key/value heads, resolving `num_query_groups: null`."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Attention head dim (C), resolving `kv_channels: null` to hidden_size // num_attention_heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def moe_layer_count(self) -> int:
        """How many layers have an MoE FFN, counted without a loop over the layers (a config's num_layers may
        be huge: validate-config must answer at once, and MOE075 refuses what torch cannot build)."""
        if isinstance(self.moe_layer_freq, list):
            return sum(1 for f in self.moe_layer_freq[: self.num_layers] if f)
        return -(-self.num_layers // self.moe_layer_freq)  # every moe_layer_freq-th layer from layer 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has an MoE FFN."""
        if isinstance(self.moe_layer_freq, list):
            return bool(self.moe_layer_freq[layer])
        return layer % self.moe_layer_freq == 0


@dataclass(kw_only=True)
class MoEConfig:
    """Router, dispatch and the grouped expert MLP."""

    num_experts: int = doc(4, "Experts per MoE layer (E).")
    router_topk: int = doc(2, "Experts each token is routed to (k).")
    ffn_hidden_size: int = doc(64, "Hidden size of each expert (F).")
    router_score_function: Literal["softmax", "sigmoid"] = doc("softmax", "Router score function.")
    router_norm_topk_prob: bool = doc(
        False, "Renormalise the top-k probabilities to sum to 1 (Mixtral, Qwen3 norm_topk_prob)."
    )
    aux_loss_coeff: float = doc(0.01, "Load-balancing auxiliary loss coefficient (0 disables).")
    z_loss_coeff: float = doc(0.0, "Router z-loss coefficient (0 disables).")
    activation: Activation = doc("swiglu", "Expert activation.")
    add_bias: bool = doc(False, "Biases on the expert linears.")
    single_grouped_weight: bool = doc(
        True, "Store each expert linear as one [E, out, in] parameter instead of weight0..weight{E-1}."
    )
    single_grouped_bias: bool = doc(False, "Store expert biases as one [E, out] parameter (needs add_bias).")
    glu_interleave_size: Optional[int] = doc(
        None, "Store fc1 rows as blocks [gate(I), up(I), ...] of this size instead of [gate; up]; null = contiguous."
    )
    backend: Literal["auto", "loop", "grouped", "fused", "te"] = doc(
        "auto",
        "Expert MLP kernels: loop (reference), grouped (torch._grouped_mm), fused (Triton), te (Transformer Engine "
        "2.20's grouped GEMMs and SwiGLU kernel; CUDA, bf16/fp32 or fp8 tensorwise: MOE022, MOE040, MOE062).",
    )
    router_padding_for_quantization: bool = doc(
        False,
        "Pad each expert's token count to the recipe's alignment with prob-0 routings (Megatron pads in the "
        "router; moectl's dispatcher pads every expert segment under a recipe, numerically the same). Needs an "
        "fp8/fp4 recipe (MOE007).",
    )
    token_dispatcher: Literal["allgather", "alltoall"] = doc(
        "alltoall", "How tokens reach experts on other expert-parallel ranks."
    )
    capacity_factor: Optional[float] = doc(
        None, "Tokens per expert = factor * T*k/E (at most T), extra tokens dropped; null = dropless."
    )
    pad_expert_input_to_capacity: bool = doc(False, "Pad every expert's input to its capacity (static shapes).")
    delay_wgrad_compute: bool = doc(
        False,
        "Compute expert weight grads after the data grads of the layer, during the expert-parallel all-to-all "
        "of the data grads (Megatron's overlap); bitwise the same grads.",
    )
    defer_expert_wgrad: bool = doc(
        False,
        "Compute the expert weight grads of a step's micro-batches at every fourth one and the last, four "
        "micro-batches in one pass over the fp32 grads (fused backend, gradient_accumulation_fusion, no recipe): "
        "faster where that pass is memory-bound, at the price of keeping up to three micro-batches' wgrad "
        "operands until then (MOE071).",
    )
    ep_overlap_chunks: int = doc(
        1,
        "Expert parallelism under drop-and-pad: split each micro-batch's expert rows into this many chunks "
        "(each expert's capacity slots in equal runs) whose all-to-alls, forward and backward, overlap the "
        "expert MLP of the other chunks. 1 = one all-to-all each way, waited on at once. Needs ep > 1, the "
        "alltoall dispatcher, pad_expert_input_to_capacity and no delay_wgrad_compute (MOE067).",
    )


@dataclass(kw_only=True)
class MixedPrecisionConfig:
    """Compute precision and low-precision param storage."""

    bf16: bool = doc(False, "Run the model in bf16 (fp32 masters, fp32 or bf16 grads).")
    fp8: Optional[Literal["e4m3", "hybrid"]] = doc(None, "FP8 format for linear layers; null = off.")
    fp8_recipe: Literal["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"] = doc(
        "tensorwise", "FP8 scaling recipe."
    )
    fp4: Optional[Literal["e2m1"]] = doc(None, "FP4 format for linear layers; null = off.")
    fp4_recipe: Literal["nvfp4"] = doc("nvfp4", "FP4 scaling recipe.")
    fp8_param_gather: bool = doc(False, "Keep params in FP8 and all-gather them in FP8.")
    fp4_param_gather: bool = doc(False, "Keep params in FP4 and all-gather them in FP4.")
    reuse_grad_buf_for_mxfp8_param_ag: bool = doc(
        False, "Stage bf16 params for the MXFP8 all-gather in the grad buffer's memory."
    )
    emulate: Literal["auto", "always", "never"] = doc(
        "auto", "Emulate recipes the device has no kernels for: auto (warn), always, never (error)."
    )
    fp8_fast_accum_backward: bool = doc(
        False,
        "Fast, non-split accumulation in the native fp8 dgrad and wgrad GEMMs, as torchao's fp8 MoE training "
        "does; false keeps split accumulation there, as TE does (fprop is always fast).",
    )


@dataclass(kw_only=True)
class ParallelConfig:
    """Data and expert parallelism, buffers, overlap."""

    expert_model_parallel_size: int = doc(1, "Expert-parallel size (ep); must divide the world size.")
    use_distributed_optimizer: bool = doc(True, "Shard fp32 masters and optimizer state over data-parallel ranks.")
    overlap_grad_reduce: Optional[bool] = doc(
        None,
        "Reduce grads bucket by bucket during backward. null = on under data parallelism (world size > 1) "
        "or with overlap_param_gather=true.",
    )
    overlap_param_gather: Optional[bool] = doc(
        None,
        "All-gather params lazily in the next forward's pre-hooks. null = on under data parallelism with the "
        "distributed optimizer and overlapped grad reduce.",
    )
    bucket_size: Optional[int] = doc(None, "Elements per bucket; null = max(40M, 1M * dp).")
    gradient_accumulation_fusion: Optional[bool] = doc(
        None,
        "Accumulate weight grads in fp32 straight into main_grad inside the GEMMs (dense: cuBLAS with beta 1; "
        "experts: a Triton grouped wgrad kernel): no bf16 grad written, read back and added. null = on where it "
        "pays: CUDA, with the distributed engine (not optimizer.optimizer=sgd).",
    )
    grad_reduce_in_fp32: bool = doc(True, "Keep and reduce grads in fp32.")
    distributed_timeout_minutes: float = doc(
        10.0,
        "How long a collective waits for the other ranks before the run fails naming the rank that timed out "
        "(a hung or stopped rank); Megatron's name and default.",
    )


@dataclass(kw_only=True)
class OptimizerConfig:
    """Optimizer, LR schedule, clipping."""

    optimizer: Literal["adam", "muon", "sgd"] = doc("adam", "adam (AdamW), muon (Adam for non-matrix params), sgd.")
    lr: float = doc(3e-3, "Peak learning rate.")
    min_lr: float = doc(0.0, "Learning rate at the end of decay.")
    weight_decay: float = doc(0.01, "Decoupled weight decay (not applied to norms and biases).")
    adam_beta1: float = doc(0.9, "Adam beta1.")
    adam_beta2: float = doc(0.95, "Adam beta2.")
    adam_eps: float = doc(1e-8, "Adam epsilon.")
    clip_grad: float = doc(1.0, "Global grad-norm clip; 0 disables.")
    lr_warmup_iters: int = doc(0, "Linear warmup steps.")
    lr_decay_style: Literal["constant", "linear", "cosine"] = doc("cosine", "Decay after warmup.")
    lr_decay_iters: Optional[int] = doc(None, "Steps over which LR decays; null = train.train_iters.")
    muon_momentum: float = doc(0.95, "Muon momentum.")
    muon_nesterov: bool = doc(True, "Nesterov momentum in Muon.")
    muon_ns_steps: int = doc(5, "Newton-Schulz iterations in Muon.")
    muon_compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = doc(
        "auto",
        "dtype of Muon's Newton-Schulz iteration (the update is applied to fp32 masters either way): auto = "
        "bfloat16 on a CUDA GPU with bf16 tensor cores (sm80+), float32 elsewhere. float32 is the reference "
        "(dp=N equals dp=1 to fp32 rounding); bfloat16 runs the iteration's GEMMs on tensor cores; float16 "
        "too, about 4x closer to float32 and without one copy per step (see trainer/optim/muon.py).",
    )
    muon_ns_method: Literal["auto", "standard", "gram"] = doc(
        "auto",
        "How Muon's Newton-Schulz runs: standard iterates on X (Keller Jordan's form); gram iterates on the "
        "[m, m] Gram side X X^T, restarting from a true Gram every 3 steps, with fp16 Gram-side matrices for a "
        "low-precision iteration (Amsel et al.'s Gram Newton-Schulz: the same polynomial, four symmetric m x m "
        "products per step instead of two m x n ones). auto = gram where it is faster (a bf16/fp16 iteration on "
        "the Triton GEMMs, slices whose long side is at least 2x the short one: the experts of the reference "
        "model), standard elsewhere (the fp32 reference among them).",
    )
    muon_split_glu: bool = doc(
        True,
        "Orthogonalise the gate and up halves of every gated fc1 weight (swiglu/quick_geglu experts, in both "
        "layouts and any moe.glu_interleave_size, and the dense SwiGLU MLP) as two [F, in] matrices, each with "
        "its own Moonlight scale: they are two linear maps stored together, as Megatron splits a fused QKV "
        "(muon_split_qkv, default on). Newton-Schulz FLOPs of such a weight: 2.4x fewer when 2F = in (the "
        "reference model's experts), 2-2.4x fewer when 2F <= in, up to 1.2x more when F >= in (a dense MLP of "
        "ffn 4x hidden: 1.06x). false = one [2F, in] matrix.",
    )
    muon_split_qkv: bool = doc(
        True,
        "Orthogonalise the query, key and value rows of every attention linear_qkv weight as three matrices "
        "([G q, in], [G kv, in], [G kv, in], each gathered over the G query groups of Megatron's row layout), "
        "each with its own Moonlight scale, as Megatron-Core's muon_split_qkv (default on there too). At the "
        "reference model's shapes ([3072, 2048] -> [2048, 2048] + 2 x [512, 2048]) 18% fewer Newton-Schulz "
        "FLOPs, no measurable change in the step on an H100. false = one [G (q + 2 kv), in] matrix.",
    )


@dataclass(kw_only=True)
class TrainConfig:
    """Batching, length, evaluation, reproducibility."""

    micro_batch_size: int = doc(4, "Sequences per micro-batch per rank.")
    global_batch_size: int = doc(16, "Sequences per optimizer step, over all data-parallel ranks.")
    train_iters: int = doc(200, "Optimizer steps.")
    eval_interval: Optional[int] = doc(50, "Evaluate every N steps (and at the end); null = never.")
    eval_iters: int = doc(4, "Micro-batches per evaluation on each data-parallel rank (so the eval set grows with "
                          "the dp size, and eval loss is comparable only between runs of one dp size).")
    seed: int = doc(1234, "Seed of init and data order.")
    deterministic: bool = doc(False, "Deterministic kernels: two runs on the same device are bit-identical.")
    cuda_graph: Optional[bool] = doc(
        None,
        "Replay each micro-batch's forward + backward from one CUDA graph, captured after the first (eager) "
        "step; under data parallelism the first micro-batch's graph holds the param gathers and the last one's the "
        "grad reductions, the optimizer stays eager. true needs a static expert input (drop-and-pad, "
        "or dropless with bf16, fp8 tensorwise/delayed or e4m3 rowwise GEMMs), a GPU, one expert-parallel rank (or the "
        "all-to-all under drop-and-pad), a grouped backend and adam/muon "
        "(MOE034, MOE035, MOE058-060). null = on where it is measured to win: an sm90/sm100 GPU, "
        "bf16 params, drop-and-pad or dropless experts, ep 1 (or ep's all-to-all under drop-and-pad), adam or "
        "muon, no fp8 or fp8 tensorwise (e4m3 or hybrid, with or without fp8 param gather), no delayed wgrad; "
        "off otherwise (fp32 params and older GPUs: torch's grouped GEMM reads its group "
        "offsets on the host there).",
    )
    compile: Literal["none", "regional", "auto"] = doc(
        "auto",
        "torch.compile of each decoder layer's two RMSNorms, attention core (head split, QK norm, RoPE, "
        "scaled dot-product attention) and MoE router; the projections, dispatch and experts stay eager. none, "
        "regional, or auto (regional on CUDA, none on CPU). The first step compiles (a minute on a GPU). With "
        "train.deterministic, inductor runs in its deterministic mode.",
    )
    log_interval: int = doc(1, "Write a metrics record every N steps (and at the last step).")
    on_nonfinite: Literal["stop", "skip"] = doc("stop", "On a non-finite loss or grad norm: stop the run, or skip the step.")
    device: Literal["auto", "cpu", "cuda"] = doc("auto", "auto = cuda when available, else cpu.")
    cpu_threads: Optional[int] = doc(
        None,
        "torch CPU threads per rank on a CPU run; null = OMP_NUM_THREADS if set, else 1 (faster and steadier on "
        "a shared machine; measured in trainer/threads.py). Set it on a dedicated many-core machine.",
    )


@dataclass(kw_only=True)
class DataConfig:
    """Where tokens come from."""

    source: Literal["corpus", "synthetic", "tokens", "megatron", "text"] = doc(
        "corpus", "corpus: the Python standard library's source as bytes (no download); see trainer/data."
    )
    path: Optional[str] = doc(None, "File or prefix for tokens, megatron and text sources.")
    tokenizer: Optional[str] = doc(None, "A local tokenizer.json for the text source; null = bytes.")
    dtype: Optional[Literal["uint8", "uint16", "int32", "uint32"]] = doc(
        None,
        "Token dtype of a flat tokens file (nanoGPT writes uint16, llm.c v7 uint32); null = from the llm.c "
        "header, a .u16/.u32 file suffix, else uint16. For megatron, a check against the index's dtype.",
    )
    eval_fraction: float = doc(0.05, "Share of the data held out for evaluation (unused with data.eval_path).")
    eval_path: Optional[str] = doc(
        None,
        "A separate validation file of the same source (nanoGPT's val.bin, a second Megatron prefix), "
        "evaluated instead of a held-out fraction; data.path then trains whole.",
    )


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and loading."""

    save_interval: Optional[int] = doc(None, "Save every N steps (and on SIGTERM); null = never.")
    load: Optional[str] = doc(None, "A step folder, or a checkpoints folder (then its `latest`).")
    load_main_params_from_ckpt: bool = doc(False, "Take fp32 masters from the checkpoint but no optimizer state.")
    no_load_optim: bool = doc(False, "Do not load optimizer state.")
    keep_last: Optional[int] = doc(None, "Keep this many newest checkpoints; null = all.")
    async_save: bool = doc(
        True,
        "Save in the background: training stops only while this rank's shards are copied to host memory "
        "(pinned on CUDA), then a thread writes, hashes and commits them. Where it cannot (several ranks "
        "without gloo for the commit vote, or too little free host memory for the copy) the save is "
        "synchronous and the run says why. false = always synchronous.",
    )


@dataclass(kw_only=True)
class LoggingConfig:
    """What a run records."""

    tensorboard: bool = doc(False, "Also write TensorBoard event files into run_dir/tb.")
    jsonl: bool = doc(True, "Write run_dir/metrics.jsonl.")


@dataclass(kw_only=True)
class Config:
    """A whole moectl run."""

    run_dir: str = doc("runs/tiny", "Metrics, logs and checkpoints go here.")
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": ModelConfig.__doc__})
    moe: MoEConfig = field(default_factory=MoEConfig, metadata={"help": MoEConfig.__doc__})
    mixed_precision: MixedPrecisionConfig = field(
        default_factory=MixedPrecisionConfig, metadata={"help": MixedPrecisionConfig.__doc__}
    )
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"help": ParallelConfig.__doc__})
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, metadata={"help": OptimizerConfig.__doc__})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": TrainConfig.__doc__})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": DataConfig.__doc__})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"help": CheckpointConfig.__doc__})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": LoggingConfig.__doc__})


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config) if f.default_factory is not MISSING}  # type: ignore[misc]


def field_help(section: str | None, key: str) -> str:
    """The docstring of `section.key` (or of a top-level key when `section` is None)."""
    cls = SECTIONS[section] if section else Config
    for f in fields(cls):
        if f.name == key:
            return f.metadata.get("help", "")
    raise KeyError(key)
