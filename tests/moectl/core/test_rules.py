"""The rule catalogue: every rule has a config that triggers it and one near its boundary that passes.

All checks run against an explicit `Environment` (no TE, no GPU) so the results do not depend on the
machine; the probes themselves are tested at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

from moectl.core import rules
from moectl.core.config import Config
from moectl.core.config.load import load_config, yaml_scalar
from moectl.core.config.schema import ParallelConfig
from moectl.core.overlap import overlap_policy
from moectl.core.rules import RETIRED, RULES, Device, Environment, TEInstall, Violation, check, has_errors

REPO = Path(__file__).resolve().parents[3]
NO_MACHINE = Environment(te=None, device=None, cpus=4)
H100 = Environment(te=None, device=Device("cuda", (9, 0), "torch.cuda: NVIDIA H100"))
TE_OK = TEInstall("2.20.2", has_pytorch=True)

BF16 = ["mixed_precision.bf16=true"]
FP8 = [*BF16, "mixed_precision.fp8=e4m3"]
MXFP8_GATHER = [
    *FP8,
    "mixed_precision.fp8_recipe=mxfp8",
    "mixed_precision.fp8_param_gather=true",
    "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true",
]
FP4 = [*BF16, "mixed_precision.fp4=e2m1"]
DROP_AND_PAD = ["moe.capacity_factor=1.25", "moe.pad_expert_input_to_capacity=true"]


def cfg(*sets: str) -> Config:
    """The defaults (a valid tiny config) with dotted overrides."""
    return load_config(None, list(sets))


def run(
    sets: list[str], world: Optional[int] = None, cap: Optional[tuple[int, int]] = None, env: Environment = NO_MACHINE
) -> list[Violation]:
    return check(cfg(*sets), world_size=world, device_capability=cap, env=env)


@dataclass
class Case:
    """A rule, overrides that trigger it, and overrides near the boundary that do not."""

    rule: str
    trigger: list[str]
    passing: list[str]
    world: Optional[int] = None
    pass_world: Optional[int] = None
    cap: Optional[tuple[int, int]] = None
    pass_cap: Optional[tuple[int, int]] = None
    env: Environment = field(default_factory=lambda: NO_MACHINE)
    pass_env: Optional[Environment] = None
    severity: str = "error"
    name: str = ""

    @property
    def id(self) -> str:
        return f"{self.rule}-{self.name}" if self.name else self.rule


CASES = [
    # precision
    Case("MOE001", [*FP8, "mixed_precision.fp4=e2m1"], [*FP8, "mixed_precision.fp4=null"]),
    Case("MOE002", ["mixed_precision.fp8_param_gather=true"], [*FP8, "mixed_precision.fp8_param_gather=true"]),
    Case("MOE003", ["mixed_precision.fp4_param_gather=true"], [*FP4, "mixed_precision.fp4_param_gather=true"]),
    Case(
        "MOE004",
        [*FP8, "mixed_precision.fp8_param_gather=true", "parallel.use_distributed_optimizer=false"],
        [*FP8, "mixed_precision.fp8_param_gather=true", "parallel.use_distributed_optimizer=true"],
        name="fp8",
    ),
    Case(
        "MOE004",
        [*FP4, "mixed_precision.fp4_param_gather=true", "parallel.use_distributed_optimizer=false"],
        [*FP4, "mixed_precision.fp4_param_gather=false", "parallel.use_distributed_optimizer=false"],
        name="fp4",
    ),
    Case("MOE005", [*MXFP8_GATHER, "mixed_precision.fp8_param_gather=false"], MXFP8_GATHER, name="no-gather"),
    Case("MOE005", [*MXFP8_GATHER, "mixed_precision.fp8_recipe=tensorwise"], MXFP8_GATHER, name="not-mxfp8"),
    Case("MOE006", [*FP8, "model.hidden_size=72"], [*FP8, "model.hidden_size=80"], name="tensorwise"),
    Case(
        "MOE006",
        [*FP8, "mixed_precision.fp8_recipe=delayed", "moe.ffn_hidden_size=40"],
        [*FP8, "mixed_precision.fp8_recipe=delayed", "moe.ffn_hidden_size=48"],
        name="delayed",
    ),
    Case(
        "MOE006",
        [*FP8, "mixed_precision.fp8_recipe=rowwise", "moe.ffn_hidden_size=8"],
        [*FP8, "mixed_precision.fp8_recipe=rowwise", "moe.ffn_hidden_size=16"],
        name="rowwise",
    ),
    Case(
        "MOE006",
        [*FP8, "mixed_precision.fp8_recipe=mxfp8", "moe.ffn_hidden_size=48"],
        [*FP8, "mixed_precision.fp8_recipe=mxfp8", "moe.ffn_hidden_size=32"],
        name="mxfp8",
    ),
    Case(
        "MOE006",
        [*FP8, "mixed_precision.fp8_recipe=blockwise", "model.hidden_size=64", "model.num_attention_heads=4"],
        [*FP8, "mixed_precision.fp8_recipe=blockwise", "model.hidden_size=128", "moe.ffn_hidden_size=128"],
        name="blockwise",
    ),
    Case("MOE006", [*FP4, "moe.ffn_hidden_size=48"], [*FP4, "moe.ffn_hidden_size=96"], name="nvfp4"),
    Case(
        "MOE006",
        [*FP8, "model.moe_layer_freq=[0, 1]", "model.ffn_hidden_size=100"],
        [*FP8, "model.moe_layer_freq=1", "model.ffn_hidden_size=100"],
        name="dense-ffn-only-when-used",
    ),
    Case("MOE007", ["moe.router_padding_for_quantization=true"], [*FP8, "moe.router_padding_for_quantization=true"]),
    Case("MOE008", ["mixed_precision.fp8=e4m3"], FP8, severity="warning"),
    Case(
        "MOE009",
        [*MXFP8_GATHER, "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=false"],
        MXFP8_GATHER,
        severity="warning",
    ),
    # optimizer and schedule
    Case(
        "MOE010",
        [*FP8, "optimizer.optimizer=muon", "mixed_precision.fp8_param_gather=true"],
        ["optimizer.optimizer=muon", *MXFP8_GATHER],
        name="tensorwise",
    ),
    Case(
        "MOE010",
        ["optimizer.optimizer=muon", *MXFP8_GATHER, "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=false"],
        ["optimizer.optimizer=muon", *MXFP8_GATHER],
        name="no-reuse",
    ),
    Case(
        "MOE011",
        [*FP4, "optimizer.optimizer=muon", "mixed_precision.fp4_param_gather=true"],
        [*FP4, "optimizer.optimizer=muon", "mixed_precision.fp4_param_gather=false"],
    ),
    Case("MOE073", ["train.seed=18446744073709551616"], ["train.seed=18446744073709551615"]),
    Case("MOE073", ["train.seed=-9223372036854775809"], ["train.seed=-9223372036854775808"], name="negative"),
    Case("MOE074", ["checkpoint.load=''"], ["checkpoint.load=null"]),
    # 2^63 itself; below it the logits [4, seq, 256] still fit, at 8 bytes an element, up to seq = 2^50 - 1
    Case("MOE075", ["model.seq_length=9223372036854775808"], ["model.seq_length=1125899906842623"]),
    Case("MOE075", ["model.seq_length=1125899906842624"], ["model.seq_length=1125899906842623"], name="logits"),
    # the experts' fc1 [E, 2 x 64, 64]: 8192 E elements, 2^16 E bytes
    Case("MOE075", ["moe.num_experts=140737488355328"], ["moe.num_experts=140737488355327"], name="experts"),
    Case("MOE075", ["model.vocab_size=10000000000", "model.hidden_size=1000000000"],
         ["model.vocab_size=1000000000", "model.hidden_size=100000000"], name="embedding-product"),
    # elements that fit, bytes that do not: a review's "Storage size calculation overflowed" at train
    Case("MOE075", ["model.vocab_size=36028797018963968"], ["model.vocab_size=2251799813685247"], name="bytes"),
    Case("MOE072", ["train.cpu_threads=5"], ["train.cpu_threads=4"], severity="warning"),
    Case("MOE072", ["train.cpu_threads=5", "train.device=cpu"], ["train.cpu_threads=4", "train.device=cpu"],
         name="cpu", severity="warning"),
    Case("MOE012", ["optimizer.lr=0"], ["optimizer.lr=1e-9"], name="lr"),
    Case("MOE012", ["optimizer.lr=.inf"], ["optimizer.lr=1e3"], name="lr-inf"),
    Case("MOE012", ["optimizer.adam_eps=1e400"], ["optimizer.adam_eps=1e-8"], name="eps-inf"),
    Case("MOE012", ["optimizer.adam_beta2=1.0"], ["optimizer.adam_beta2=0.999"], name="beta2"),
    Case("MOE012", ["optimizer.adam_eps=0"], ["optimizer.adam_eps=1e-12"], name="eps"),
    Case("MOE012", ["optimizer.clip_grad=-1"], ["optimizer.clip_grad=0"], name="clip"),
    Case("MOE012", ["optimizer.weight_decay=-0.1"], ["optimizer.weight_decay=0"], name="wd"),
    Case(
        "MOE012",
        ["optimizer.optimizer=muon", "optimizer.muon_momentum=1.0"],
        ["optimizer.optimizer=muon", "optimizer.muon_momentum=0.99"],
        name="muon-momentum",
    ),
    Case(
        "MOE012",
        ["optimizer.optimizer=adam", "optimizer.adam_beta1=-0.5"],
        ["optimizer.optimizer=sgd", "optimizer.adam_beta1=-0.5"],
        name="unused-by-sgd",
    ),
    Case("MOE013", ["optimizer.lr=1e-3", "optimizer.min_lr=2e-3"], ["optimizer.lr=1e-3", "optimizer.min_lr=1e-3"]),
    Case(
        "MOE013",
        ["optimizer.lr=1e-3", "optimizer.min_lr=2e-3"],
        ["optimizer.lr=1e-3", "optimizer.min_lr=2e-3", "optimizer.lr_decay_style=constant"],
        name="constant",
    ),
    Case(
        "MOE014",
        ["optimizer.lr_warmup_iters=10", "optimizer.lr_decay_iters=10"],
        ["optimizer.lr_warmup_iters=9", "optimizer.lr_decay_iters=10"],
    ),
    Case(
        "MOE015",
        ["optimizer.lr_warmup_iters=150", "train.train_iters=150"],
        ["optimizer.lr_warmup_iters=149", "train.train_iters=150"],
        severity="warning",
    ),
    # overlap
    Case(
        "MOE016",
        ["parallel.overlap_param_gather=true", "parallel.overlap_grad_reduce=false"],
        ["parallel.overlap_param_gather=true"],  # a null reduce follows a set gather
    ),
    Case(
        "MOE017",
        [
            "parallel.overlap_param_gather=true",
            "parallel.overlap_grad_reduce=true",
            "parallel.use_distributed_optimizer=false",
        ],
        ["parallel.overlap_param_gather=true", "parallel.overlap_grad_reduce=true"],
    ),
    # MoE
    Case("MOE018", ["moe.router_topk=5"], ["moe.router_topk=4"], name="above"),
    Case("MOE018", ["moe.router_topk=0"], ["moe.router_topk=1"], name="zero"),
    Case(
        "MOE019",
        ["moe.glu_interleave_size=32", "moe.activation=squared_relu"],
        ["moe.glu_interleave_size=32", "moe.activation=quick_geglu"],
    ),
    Case("MOE020", ["moe.glu_interleave_size=24"], ["moe.glu_interleave_size=32"]),
    Case("MOE020", ["moe.glu_interleave_size=128"], ["moe.glu_interleave_size=64"], name="larger-than-F"),
    Case("MOE021", ["moe.single_grouped_bias=true"], ["moe.single_grouped_bias=true", "moe.add_bias=true"]),
    Case("MOE022", ["moe.backend=te"], ["moe.backend=auto"], name="not-installed"),
    Case(
        "MOE022",
        ["moe.backend=te"],
        ["moe.backend=te"],
        env=Environment(te=TEInstall("2.19.0", True), device=None),
        pass_env=Environment(te=TEInstall("2.20.0", True), device=None),
        name="too-old",
    ),
    Case(
        "MOE022",
        ["moe.backend=te"],
        ["moe.backend=te"],
        env=Environment(te=TEInstall("2.21.0", True), device=None),
        pass_env=Environment(te=TEInstall("2.20.2", True), device=None),
        severity="warning",
        name="newer-than-pinned",
    ),
    Case(
        "MOE062",
        ["moe.backend=te", *FP8, "mixed_precision.fp8_recipe=mxfp8"],
        ["moe.backend=te", *FP8, "mixed_precision.fp8_recipe=tensorwise"],
        env=Environment(te=TE_OK, device=None),
        name="recipe",
    ),
    Case("MOE062", ["moe.backend=te", *FP4], ["moe.backend=fused", *FP4], env=Environment(te=TE_OK, device=None),
         name="fp4"),
    Case(
        "MOE062",
        ["moe.backend=te", *FP8, "mixed_precision.fp8_param_gather=true"],
        ["moe.backend=te", *FP8, "mixed_precision.fp8_param_gather=false"],
        env=Environment(te=TE_OK, device=None),
        name="param-gather",
    ),
    Case("MOE023", ["moe.aux_loss_coeff=-0.01"], ["moe.aux_loss_coeff=0"], name="aux"),
    Case("MOE023", ["moe.z_loss_coeff=-1e-3"], ["moe.z_loss_coeff=0"], name="z"),
    Case("MOE023", ["moe.capacity_factor=0"], ["moe.capacity_factor=0.01"], name="capacity"),
    Case("MOE024", ["moe.pad_expert_input_to_capacity=true"], DROP_AND_PAD),
    Case(
        "MOE025",
        ["moe.delay_wgrad_compute=true"],
        ["moe.delay_wgrad_compute=true", "parallel.expert_model_parallel_size=2"],
        severity="warning",
    ),
    Case("MOE026", ["model.moe_layer_freq=[1]"], ["model.moe_layer_freq=[1, 0]"], name="length"),
    Case("MOE026", ["model.moe_layer_freq=[1, 2]"], ["model.moe_layer_freq=[1, 1]"], name="entries"),
    Case("MOE026", ["model.moe_layer_freq=0"], ["model.moe_layer_freq=3"], name="int"),
    Case("MOE027", ["model.moe_layer_freq=[0, 0]"], ["model.moe_layer_freq=[0, 1]"], severity="warning"),
    # parallel
    Case(
        "MOE028",
        ["moe.num_experts=6", "parallel.expert_model_parallel_size=4"],
        ["moe.num_experts=8", "parallel.expert_model_parallel_size=4"],
    ),
    Case(
        "MOE029",
        ["parallel.expert_model_parallel_size=2"],
        ["parallel.expert_model_parallel_size=2"],
        world=3,
        pass_world=6,
    ),
    Case(
        "MOE030",
        ["train.global_batch_size=16", "train.micro_batch_size=4"],
        ["train.global_batch_size=24", "train.micro_batch_size=4"],
        world=3,
        pass_world=3,
    ),
    Case("MOE030", ["train.global_batch_size=18"], ["train.global_batch_size=20"], name="one-rank"),
    Case("MOE031", ["model.hidden_size=66"], ["model.hidden_size=72"]),
    Case("MOE031", ["model.hidden_size=66"], ["model.hidden_size=66", "model.kv_channels=16"], name="kv-channels"),
    Case("MOE032", ["model.num_query_groups=3"], ["model.num_query_groups=4"]),
    Case("MOE033", ["model.hidden_size=68"], ["model.hidden_size=72"]),
    Case("MOE033", ["model.kv_channels=15"], ["model.kv_channels=16"], name="kv-channels"),
    # CUDA graphs
    Case(
        "MOE034",
        ["train.cuda_graph=true", "mixed_precision.bf16=true", "mixed_precision.fp8=hybrid",
         "mixed_precision.fp8_recipe=rowwise"],
        ["train.cuda_graph=true", "mixed_precision.bf16=true", "mixed_precision.fp8=hybrid",
         "mixed_precision.fp8_recipe=rowwise", *DROP_AND_PAD],
        name="dropless-fp8-emulated",
    ),
    Case(
        "MOE034",
        ["train.cuda_graph=true", "mixed_precision.bf16=true", "mixed_precision.fp8=e4m3",
         "mixed_precision.fp8_recipe=mxfp8"],
        ["train.cuda_graph=true", "mixed_precision.bf16=true", "mixed_precision.fp8=e4m3"],  # native grouped
        name="dropless-fp8-device-offsets",
    ),
    Case(
        "MOE034",
        ["train.cuda_graph=true", "mixed_precision.bf16=true", "mixed_precision.fp8=e4m3",
         "mixed_precision.fp8_recipe=blockwise"],
        ["train.cuda_graph=true", "mixed_precision.bf16=true"],  # bf16 dropless: T*K rows, device offsets
        name="dropless-bf16",
    ),
    Case(
        "MOE034",
        ["train.cuda_graph=true", "moe.capacity_factor=1.0"],
        ["train.cuda_graph=true", *DROP_AND_PAD],
        name="no-pad",
    ),
    Case(
        "MOE034",
        ["train.cuda_graph=true", "moe.capacity_factor=1.0", "model.moe_layer_freq=[0, 1]"],
        ["train.cuda_graph=true", "moe.capacity_factor=1.0", "model.moe_layer_freq=[0, 0]"],
        name="dense-model",
    ),
    Case(
        "MOE035",
        ["train.cuda_graph=true", *DROP_AND_PAD, "train.device=cpu"],
        ["train.cuda_graph=true", *DROP_AND_PAD, "train.device=cuda"],
    ),
    # checkpoint
    Case(
        "MOE036",
        ["checkpoint.load_main_params_from_ckpt=true", "checkpoint.no_load_optim=true"],
        ["checkpoint.load_main_params_from_ckpt=true", "checkpoint.no_load_optim=true", "checkpoint.load=ck/step_1"],
        name="no-load",
    ),
    Case(
        "MOE036",
        ["checkpoint.load_main_params_from_ckpt=true", "checkpoint.load=ck/step_1"],
        ["checkpoint.load_main_params_from_ckpt=true", "checkpoint.no_load_optim=true", "checkpoint.load=ck/step_1"],
        name="loads-optim",
    ),
    Case(
        "MOE037",
        ["checkpoint.no_load_optim=true"],
        ["checkpoint.no_load_optim=true", "checkpoint.load=ck"],
        severity="warning",
    ),
    # hardware
    Case(
        "MOE038",
        [*FP8, "mixed_precision.fp8_recipe=mxfp8"],
        [*FP8, "mixed_precision.fp8_recipe=tensorwise"],
        cap=(10, 0),
        pass_cap=(10, 0),
        severity="warning",
        name="mxfp8-emulated-even-on-blackwell",
    ),
    Case(
        "MOE038",
        [*FP8, "mixed_precision.fp8_recipe=mxfp8", "mixed_precision.emulate=never"],
        [*FP8, "mixed_precision.fp8_recipe=tensorwise", "mixed_precision.emulate=never"],
        cap=(9, 0),
        pass_cap=(9, 0),
        name="emulate-never",
    ),
    Case(
        "MOE038",
        [*FP8, "mixed_precision.emulate=always"],
        [*FP8, "mixed_precision.emulate=always"],
        cap=(8, 9),
        pass_cap=(9, 0),
        severity="warning",
        name="tensorwise-before-hopper",  # sm89 has _scaled_mm but not _scaled_grouped_mm: experts emulate
    ),
    Case(
        "MOE038",
        [*FP8, "mixed_precision.fp8_recipe=rowwise"],
        [*FP8, "mixed_precision.fp8_recipe=rowwise"],
        cap=(12, 0),
        pass_cap=(10, 0),
        severity="warning",
        name="no-grouped-kernel-on-sm120",
    ),
    Case(
        "MOE038",
        [*BF16, "mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=rowwise", "mixed_precision.emulate=never"],
        [*BF16, "mixed_precision.fp8=hybrid", "mixed_precision.emulate=never"],  # tensorwise: Triton backward
        cap=(9, 0),
        pass_cap=(9, 0),
        name="hybrid-rowwise-grads-emulate-the-backward",
    ),
    Case("MOE038", [*FP4], [*BF16], cap=(10, 0), pass_cap=(10, 0), severity="warning", name="nvfp4"),
    Case("MOE038", [*FP8, "train.device=cpu"], [*BF16, "train.device=cpu"], severity="warning", name="cpu"),
    Case("MOE039", BF16, BF16, cap=(7, 5), pass_cap=(8, 0), severity="warning"),
    Case(
        "MOE063",
        [*FP8, "model.kv_channels=18"],
        [*FP8, "model.kv_channels=16"],
        cap=(9, 0),
        pass_cap=(9, 0),
        severity="warning",
        name="attention-widths",
    ),
    Case(
        "MOE063",
        [*FP8, "mixed_precision.emulate=never", "train.micro_batch_size=1", "model.seq_length=100"],
        [*FP8, "mixed_precision.emulate=never", "train.micro_batch_size=1", "model.seq_length=112"],
        cap=(9, 0),
        pass_cap=(9, 0),
        name="tokens-of-the-dense-wgrad",
    ),
    Case(
        "MOE063",
        [*BF16, "mixed_precision.fp8=hybrid", "mixed_precision.emulate=never"],
        [*BF16, "mixed_precision.fp8=hybrid", "mixed_precision.emulate=never", "model.hidden_size=128",
         "moe.ffn_hidden_size=128"],
        cap=(9, 0),
        pass_cap=(9, 0),
        name="hybrid-expert-grads-in-128-wide-tiles",
    ),
    Case(
        "MOE040",
        ["moe.backend=te", "train.device=cpu"],
        ["moe.backend=te", "train.device=cuda"],
        env=Environment(te=TE_OK, device=None),
    ),
    # model, data, training
    Case("MOE041", ["model.seq_length=0"], ["model.seq_length=1"], name="seq_length"),
    Case("MOE041", ["checkpoint.keep_last=0"], ["checkpoint.keep_last=1"], name="keep_last"),
    Case("MOE041", ["train.eval_interval=0"], ["train.eval_interval=1"], name="eval_interval"),
    Case("MOE041", ["train.eval_iters=0"], ["train.eval_iters=0", "train.eval_interval=null"], name="eval_iters"),
    Case("MOE041", ["optimizer.lr_warmup_iters=-1"], ["optimizer.lr_warmup_iters=0"], name="warmup"),
    Case("MOE041", ["parallel.bucket_size=0"], ["parallel.bucket_size=1"], name="bucket"),
    Case("MOE041", ["model.kv_channels=0"], ["model.kv_channels=2"], name="kv_channels"),
    Case("MOE041", ["train.cpu_threads=0"], ["train.cpu_threads=1"], name="cpu_threads"),
    Case(
        "MOE041",
        ["optimizer.optimizer=muon", "optimizer.muon_ns_steps=0"],
        ["optimizer.optimizer=adam", "optimizer.muon_ns_steps=0"],
        name="muon_ns_steps",
    ),
    Case("MOE042", ["model.init_method_std=0"], ["model.init_method_std=1e-6"], name="std"),
    Case("MOE042", ["model.rotary_base=1"], ["model.rotary_base=1.5"], name="rope"),
    Case("MOE042", ["model.norm_epsilon=0"], ["model.norm_epsilon=1e-12"], name="eps"),
    Case("MOE043", ["model.vocab_size=255"], ["model.vocab_size=256"], name="corpus"),
    Case(
        "MOE043",
        ["data.source=text", "data.path=x.txt", "model.vocab_size=100"],
        ["data.source=text", "data.path=x.txt", "data.tokenizer=tok.json", "model.vocab_size=100"],
        name="text",
    ),
    Case("MOE043", ["model.vocab_size=100"], ["data.source=synthetic", "model.vocab_size=100"], name="synthetic"),
    Case("MOE044", ["data.source=tokens"], ["data.source=tokens", "data.path=x.bin"], name="tokens"),
    Case("MOE044", ["data.source=megatron"], ["data.source=corpus"], name="megatron"),
    Case(
        "MOE046",
        ["data.tokenizer=tok.json"],
        ["data.tokenizer=tok.json", "data.source=text", "data.path=x.txt"],
        severity="warning",
    ),
    Case("MOE047", ["data.eval_fraction=0"], ["data.eval_fraction=0", "train.eval_interval=null"], name="no-holdout"),
    Case(
        "MOE047",
        ["data.eval_fraction=1.0", "train.eval_interval=null"],
        ["data.eval_fraction=0.99", "train.eval_interval=null"],
        name="all-holdout",
    ),
    Case(
        "MOE048",
        [*FP8, "mixed_precision.fp8_recipe=rowwise", "mixed_precision.fp8_param_gather=true"],
        [*FP8, "mixed_precision.fp8_recipe=delayed", "mixed_precision.fp8_param_gather=true"],
        name="rowwise",
    ),
    Case(
        "MOE048",
        [*FP8, "mixed_precision.fp8_recipe=rowwise", "model.hidden_size=128", "moe.ffn_hidden_size=128",
         "model.ffn_hidden_size=128", "mixed_precision.fp8_param_gather=true"],
        [*FP8, "mixed_precision.fp8_recipe=blockwise", "model.hidden_size=128", "moe.ffn_hidden_size=128",
         "model.ffn_hidden_size=128", "mixed_precision.fp8_param_gather=true"],
        name="blockwise-gathers",
    ),
    Case(
        "MOE048",
        [*FP4, "mixed_precision.fp4_param_gather=true", "optimizer.optimizer=sgd"],
        [*FP4, "mixed_precision.fp4_param_gather=true", "optimizer.optimizer=adam"],
        name="sgd",
    ),
    Case(
        "MOE049",
        [*BF16, "mixed_precision.fp8_fast_accum_backward=true"],
        [*FP8, "mixed_precision.fp8_fast_accum_backward=true"],
        name="no-fp8",
    ),
    Case(
        "MOE049",
        [*FP8, "mixed_precision.fp8_recipe=mxfp8", "mixed_precision.fp8_fast_accum_backward=true"],
        [*FP8, "mixed_precision.fp8_recipe=delayed", "mixed_precision.fp8_fast_accum_backward=true"],
        severity="warning",
        name="emulated",
    ),
    Case("MOE058", ["train.cuda_graph=true", *DROP_AND_PAD, "parallel.expert_model_parallel_size=2",
                    "moe.token_dispatcher=allgather"],
         ["train.cuda_graph=true", *DROP_AND_PAD], world=2, pass_world=2),
    Case("MOE058", ["train.cuda_graph=true", "parallel.expert_model_parallel_size=2"],
         ["train.cuda_graph=true", *DROP_AND_PAD, "parallel.expert_model_parallel_size=2"], world=2, pass_world=2,
         name="alltoall-drop-and-pad"),
    Case("MOE058", ["train.cuda_graph=true", *DROP_AND_PAD, "parallel.expert_model_parallel_size=2",
                    "moe.delay_wgrad_compute=true"],
         ["train.cuda_graph=true", *DROP_AND_PAD, "parallel.expert_model_parallel_size=2"], world=2, pass_world=2,
         name="delayed-wgrad"),
    Case("MOE064", ["parallel.expert_model_parallel_size=2", "mixed_precision.bf16=true"],
         ["parallel.expert_model_parallel_size=2", "mixed_precision.bf16=true", *DROP_AND_PAD], world=2,
         pass_world=2, env=H100, severity="warning"),
    Case("MOE064", ["parallel.expert_model_parallel_size=2", "mixed_precision.bf16=true",
                    "moe.token_dispatcher=allgather"],
         ["parallel.expert_model_parallel_size=2", "mixed_precision.bf16=true", "train.cuda_graph=false"], world=2,
         pass_world=2, env=H100, severity="warning", name="allgather"),
    Case("MOE064", ["parallel.expert_model_parallel_size=2", "mixed_precision.bf16=true"],
         ["parallel.expert_model_parallel_size=2", "mixed_precision.bf16=true"], world=2, pass_world=2, env=H100,
         pass_env=Environment(te=None, device=Device("cpu")), severity="warning", name="cuda-only"),
    # where drop-and-pad alone would not make null capture (fp32 params, delayed wgrad), it would not help
    Case("MOE064", ["parallel.expert_model_parallel_size=2", "mixed_precision.bf16=true"],
         ["parallel.expert_model_parallel_size=2"], world=2, pass_world=2, env=H100, severity="warning",
         name="fp32-params"),
    Case("MOE064", ["parallel.expert_model_parallel_size=2", "mixed_precision.bf16=true"],
         ["parallel.expert_model_parallel_size=2", "mixed_precision.bf16=true", "moe.delay_wgrad_compute=true"],
         world=2, pass_world=2, env=H100, severity="warning", name="delayed-wgrad"),
    Case("MOE065", ["parallel.expert_model_parallel_size=2", "moe.token_dispatcher=allgather", *DROP_AND_PAD],
         ["parallel.expert_model_parallel_size=2", "moe.token_dispatcher=alltoall", *DROP_AND_PAD], world=2,
         pass_world=2),
    Case("MOE065", ["parallel.expert_model_parallel_size=2", "moe.token_dispatcher=allgather",
                    "moe.capacity_factor=1.0"],
         ["moe.token_dispatcher=allgather", "moe.capacity_factor=1.0"], world=2, pass_world=2, name="one-ep-rank"),
    Case("MOE067", ["parallel.expert_model_parallel_size=2", "moe.ep_overlap_chunks=2"],
         ["parallel.expert_model_parallel_size=2", "moe.ep_overlap_chunks=2", *DROP_AND_PAD], world=2, pass_world=2,
         name="dropless"),
    Case("MOE067", ["moe.ep_overlap_chunks=2", *DROP_AND_PAD],
         ["parallel.expert_model_parallel_size=2", "moe.ep_overlap_chunks=2", *DROP_AND_PAD], world=2, pass_world=2,
         name="one-ep-rank"),
    Case("MOE067", ["parallel.expert_model_parallel_size=2", "moe.ep_overlap_chunks=2", *DROP_AND_PAD,
                    "moe.delay_wgrad_compute=true"],
         ["parallel.expert_model_parallel_size=2", "moe.ep_overlap_chunks=2", *DROP_AND_PAD], world=2, pass_world=2,
         name="delayed-wgrad"),
    Case("MOE067", ["moe.ep_overlap_chunks=0"], ["moe.ep_overlap_chunks=1"], name="zero"),
    # capacity 1.25 x T tokens x topk / E experts, with the default config's T, topk and E
    Case("MOE067", ["parallel.expert_model_parallel_size=2", "moe.ep_overlap_chunks=3", *DROP_AND_PAD],
         ["parallel.expert_model_parallel_size=2", "moe.ep_overlap_chunks=2", *DROP_AND_PAD], world=2, pass_world=2,
         name="capacity-divisor"),
    Case("MOE067", ["parallel.expert_model_parallel_size=2", "moe.ep_overlap_chunks=2", *DROP_AND_PAD,
                    "mixed_precision.bf16=true", "mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=delayed"],
         ["parallel.expert_model_parallel_size=2", "moe.ep_overlap_chunks=2", *DROP_AND_PAD, "mixed_precision.bf16=true",
          "mixed_precision.fp8=e4m3", "mixed_precision.fp8_recipe=tensorwise"], world=2, pass_world=2,
         name="delayed-fp8"),
    Case("MOE068", ["run_dir=''"], ["run_dir=."]),
    Case("MOE069", ["train.device=cuda"], ["train.device=cuda"], env=Environment(te=None, device=Device(
        "cpu", None, "--device-capability cpu")), pass_env=H100),
    Case("MOE069", ["train.device=cuda"], ["train.device=auto"], env=Environment(te=None, device=Device(
        "cpu", None, "--device-capability cpu")), name="auto"),
    Case("MOE068", ["run_dir=' '"], ["run_dir=runs/x"], name="blank"),
    Case("MOE070", ["optimizer.optimizer=sgd"], ["optimizer.optimizer=sgd"], world=2, pass_world=1),
    Case("MOE070", ["optimizer.optimizer=sgd", "mixed_precision.bf16=true"],
         ["optimizer.optimizer=adam", "mixed_precision.bf16=true"], name="bf16"),
    Case("MOE070", ["optimizer.optimizer=sgd", "parallel.gradient_accumulation_fusion=true"],
         ["optimizer.optimizer=sgd", "parallel.gradient_accumulation_fusion=null"], name="fusion"),
    Case("MOE071", ["moe.defer_expert_wgrad=true", "moe.backend=grouped"], ["moe.defer_expert_wgrad=true"],
         severity="warning"),
    Case("MOE071", ["moe.defer_expert_wgrad=true", "parallel.gradient_accumulation_fusion=false"],
         ["moe.defer_expert_wgrad=true", "parallel.gradient_accumulation_fusion=null"], severity="warning",
         name="unfused"),
    Case("MOE071", ["moe.defer_expert_wgrad=true", "train.device=cpu"],
         ["moe.defer_expert_wgrad=true", "train.device=cpu", "moe.backend=fused",
          "parallel.gradient_accumulation_fusion=true"], severity="warning", name="cpu-auto"),
    Case("MOE071", ["moe.defer_expert_wgrad=true", "train.global_batch_size=4"],
         ["moe.defer_expert_wgrad=true", "train.global_batch_size=8"], severity="warning", name="one-micro-batch"),
    Case("MOE071", ["moe.defer_expert_wgrad=true", "moe.delay_wgrad_compute=true",
                    "parallel.expert_model_parallel_size=2"],
         ["moe.defer_expert_wgrad=true", "parallel.expert_model_parallel_size=2"], world=2, pass_world=2,
         severity="warning", name="delayed"),
    Case("MOE059", ["train.cuda_graph=true", *DROP_AND_PAD, "moe.backend=loop"],
         ["train.cuda_graph=true", *DROP_AND_PAD, "moe.backend=grouped"]),
    Case("MOE059", ["train.cuda_graph=true", *DROP_AND_PAD, "moe.backend=te"],
         ["train.cuda_graph=true", *DROP_AND_PAD, "moe.backend=fused"], env=Environment(te=TE_OK, device=None),
         name="te"),
    Case("MOE060", ["train.cuda_graph=true", *DROP_AND_PAD, "optimizer.optimizer=sgd"],
         ["train.cuda_graph=true", *DROP_AND_PAD]),
    Case(
        "MOE047",
        ["data.eval_fraction=0"],
        ["data.eval_fraction=0", "data.source=tokens", "data.path=t.bin", "data.eval_path=v.bin"],
        name="eval-path",
    ),
    Case("MOE051", ["data.dtype=uint32"], ["data.dtype=uint32", "data.source=tokens", "data.path=t.bin"], name="dtype"),
    Case(
        "MOE051",
        ["data.eval_path=v.bin", "data.source=synthetic"],
        ["data.eval_path=v.bin", "data.source=text", "data.path=t.txt"],
        name="eval-path",
    ),
    Case(  # a user trial: data.path with the corpus source trained on the stdlib without a word
        "MOE051",
        ["data.path=mine.bin", "data.source=corpus"],
        ["data.path=mine.bin", "data.source=tokens"],
        name="path",
    ),
    Case(
        "MOE052",
        ["data.source=tokens", "data.path=t.bin", "data.eval_path=./t.bin"],
        ["data.source=tokens", "data.path=t.bin", "data.eval_path=v.bin"],
        severity="warning",
    ),
    Case(
        "MOE052",
        ["data.source=tokens", "data.path=t.bin", f"data.eval_path={Path.cwd() / 't.bin'}"],
        ["data.source=tokens", "data.path=t.bin", f"data.eval_path={Path.cwd() / 'v.bin'}"],
        severity="warning", name="relative-and-absolute",
    ),
    Case(
        "MOE052",
        ["data.source=megatron", "data.path=corpus_text_document", "data.eval_path=corpus_text_document.idx"],
        ["data.source=megatron", "data.path=corpus_text_document", "data.eval_path=held_out_text_document.idx"],
        severity="warning", name="megatron-prefix",
    ),
    Case(
        "MOE053",
        ["optimizer.muon_compute_dtype=float32"],
        ["optimizer.muon_compute_dtype=float32", "optimizer.optimizer=muon"],
        severity="warning",
    ),
    Case(
        "MOE053",
        ["optimizer.muon_ns_method=gram"],
        ["optimizer.muon_ns_method=gram", "optimizer.optimizer=muon"],
        severity="warning",
        name="ns-method",
    ),
    Case("MOE053", ["optimizer.muon_ns_steps=3"], ["optimizer.muon_ns_steps=5"], severity="warning", name="ns-steps"),
    Case("MOE053", ["optimizer.muon_split_qkv=false"], ["optimizer.muon_split_qkv=false", "optimizer.optimizer=muon"],
         severity="warning", name="split-qkv"),
    Case(
        "MOE054",
        ["optimizer.optimizer=muon", "optimizer.muon_compute_dtype=bfloat16"],
        ["optimizer.optimizer=muon", "optimizer.muon_compute_dtype=bfloat16"],
        cap=(7, 5),
        pass_cap=(8, 0),
        severity="warning",
    ),
    Case(
        "MOE054",
        ["optimizer.optimizer=muon", "optimizer.muon_compute_dtype=bfloat16"],
        ["optimizer.optimizer=muon", "optimizer.muon_compute_dtype=auto"],
        cap=(7, 5),
        pass_cap=(7, 5),
        severity="warning",
        name="auto-picks-fp32",
    ),
    # compile: regional on the CPU without a C++ compiler; auto never compiles there, so it passes
    Case(
        "MOE055",
        ["train.compile=regional", "train.device=cpu"],
        ["train.compile=auto", "train.device=cpu"],
        env=Environment(te=None, device=None, cxx=None),
        name="no-cxx",
    ),
    Case(
        "MOE055",
        ["train.compile=regional", "train.device=cpu"],
        ["train.compile=regional", "train.device=cpu"],
        env=Environment(te=None, device=None, cxx=None),
        pass_env=Environment(te=None, device=None, cxx="/usr/bin/g++"),
        name="with-cxx",
    ),
    Case("MOE057", ["parallel.distributed_timeout_minutes=0"], ["parallel.distributed_timeout_minutes=0.01"]),
]

# Rules whose boundary needs files, probes or arguments of their own; each has its own tests below.
TESTED_ELSEWHERE = {"MOE045", "MOE056"}


def hits(violations: list[Violation], rule: str) -> list[Violation]:
    return [v for v in violations if v.rule == rule]


def test_defaults_and_tiny_are_clean() -> None:
    assert run([]) == []
    assert check(load_config(REPO / "configs" / "tiny.yaml"), env=NO_MACHINE) == []


def test_every_rule_has_a_case() -> None:
    assert {c.rule for c in CASES} | TESTED_ELSEWHERE == set(RULES)


def test_ids_are_sequential_and_documented() -> None:
    ids = sorted([*RULES, *RETIRED])
    assert ids == [f"MOE{i:03d}" for i in range(1, len(ids) + 1)] and not set(RULES) & set(RETIRED)
    for r in RULES.values():
        assert r.rationale and r.summary and r.keys and r.severity in ("error", "warning", "error|warning")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rule_triggers(case: Case) -> None:
    found = hits(run(case.trigger, case.world, case.cap, case.env), case.rule)
    assert found, f"{case.rule} did not fire"
    overridden = {s.split("=", 1)[0]: yaml_scalar(s.split("=", 1)[1]) for s in case.trigger}
    shown: dict = {}
    for v in found:
        assert v.severity == case.severity
        assert v.message and v.fix and v.keys
        json.dumps(v.to_json())  # keys and values are plain data
        shown.update(v.keys)
    # the violation names the keys it is about, with the values the config has
    named = [k for k in overridden if k in shown]
    assert named or case.world or case.cap or "device" in shown, (shown, overridden)
    for k in named:
        assert shown[k] == overridden[k], k


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rule_passes_at_its_boundary(case: Case) -> None:
    world = case.pass_world if case.pass_world is not None else case.world
    cap = case.pass_cap if case.pass_cap is not None else case.cap
    env = case.pass_env if case.pass_env is not None else case.env
    assert hits(run(case.passing, world, cap, env), case.rule) == []


def test_gemm_dims_violation_names_each_bad_dim() -> None:
    found = hits(
        run(
            [
                *FP8,
                "mixed_precision.fp8_recipe=mxfp8",
                "model.hidden_size=48",
                "model.num_attention_heads=4",
                "moe.ffn_hidden_size=80",
            ]
        ),
        "MOE006",
    )
    assert sorted(next(iter(v.keys)) for v in found) == ["model.hidden_size", "moe.ffn_hidden_size"]
    assert all(v.keys["mixed_precision.fp8_recipe"] == "mxfp8" for v in found)
    assert "e.g. 64" in found[0].fix  # the next multiple of 32 above 48


def test_te_rule_reports_what_it_found() -> None:
    def te_message(te: Optional[TEInstall]) -> list[str]:
        return [v.message for v in hits(run(["moe.backend=te"], env=Environment(te=te, device=None)), "MOE022")]

    assert "not installed" in te_message(None)[0]
    assert "2.19.0" in te_message(TEInstall("2.19.0", True))[0]
    assert "PyTorch" in te_message(TEInstall("2.20.1", False))[0]
    assert "unknown version" in te_message(TEInstall(None, True))[0]
    assert te_message(TEInstall("2.20.0.dev0+abc", True)) == []
    assert "written against Transformer Engine 2.20.2; found: transformer_engine 3.0" in te_message(TEInstall("3.0", True))[0]
    v = hits(run(["moe.backend=te"], env=Environment(te=TEInstall("2.19.0", True), device=None)), "MOE022")[0]
    assert v.keys == {"moe.backend": "te", "transformer_engine": "transformer_engine 2.19.0"}


def test_gemm_width_rule_speaks_only_for_gemms_native_on_the_device() -> None:
    odd_heads = [*FP8, "model.kv_channels=18"]
    assert hits(run(odd_heads, cap=(9, 0)), "MOE063")
    assert hits(run(odd_heads, cap=(8, 0)), "MOE063") == []  # no fp8 GEMMs on sm80: MOE038 reports that
    assert hits(run(odd_heads), "MOE063") == []  # no known device
    assert hits(run([*odd_heads, "mixed_precision.emulate=always"], cap=(9, 0)), "MOE063") == []
    # hybrid's grouped forward is torch's (multiples of 16): only its data and weight grads want 128
    (v,) = hits(run([*BF16, "mixed_precision.fp8=hybrid"], cap=(9, 0)), "MOE063")
    assert "(dgrad/wgrad)" in v.message and v.severity == "warning" and "fp8=e4m3" in v.fix
    assert hits(run([*BF16, "mixed_precision.fp8=hybrid", "moe.backend=loop"], cap=(9, 0)), "MOE063") == []
    # gated: fc1's data and weight grads see 2F, so F=64 limits only fc2's data grad
    (v,) = hits(run([*BF16, "mixed_precision.fp8=hybrid", "model.hidden_size=128"], cap=(9, 0)), "MOE063")
    assert "moe.ffn_hidden_size=64 (dgrad):" in v.message and "model.hidden_size" not in v.message
    # a width MOE006 already refuses (not a multiple of 16) is not reported again
    assert hits(run([*BF16, "mixed_precision.fp8=hybrid", "moe.ffn_hidden_size=72", "model.hidden_size=128"],
                    cap=(9, 0)), "MOE063") == []  # fmt: skip


@pytest.mark.parametrize(
    "bad",
    [["model.num_attention_heads=0"], ["model.kv_channels=-3"], ["model.num_query_groups=0"],
     ["train.micro_batch_size=0"], ["model.seq_length=-1"], ["model.hidden_size=0"], ["moe.ffn_hidden_size=-64"]],
)
def test_gemm_width_rule_does_not_raise_on_bad_values(bad: list[str]) -> None:
    for fp8 in ("e4m3", "hybrid"):
        run([*BF16, f"mixed_precision.fp8={fp8}", *bad], cap=(9, 0))  # MOE041 and others report the values


def test_hardware_rule_is_silent_without_a_known_device() -> None:
    assert hits(run([*FP8, "mixed_precision.fp8_recipe=mxfp8", "mixed_precision.emulate=never"]), "MOE038") == []


def test_hardware_rule_uses_the_visible_gpu_when_no_capability_is_given() -> None:
    h100 = Environment(te=None, device=Device("cuda", (9, 0), "torch.cuda: NVIDIA H100"))
    found = hits(
        run(
            [*FP8, "mixed_precision.fp8_recipe=blockwise", "model.hidden_size=128", "moe.ffn_hidden_size=128"], env=h100
        ),
        "MOE038",
    )
    assert [v.keys["device"] for v in found] == ["sm90 (torch.cuda: NVIDIA H100)"]
    assert hits(run(FP8, env=h100), "MOE038") == []  # tensorwise e4m3 is native on the visible sm90
    # an explicit capability wins over the visible GPU
    (v,) = hits(run(FP8, cap=(8, 9), env=h100), "MOE038")
    assert v.keys["device"] == "sm89 (--device-capability)"


def test_hardware_rule_names_the_emulated_gemms() -> None:
    (v,) = hits(run([*BF16, "mixed_precision.fp8=hybrid"], cap=(8, 9)), "MOE038")  # Ada: no grouped fp8 kernel
    assert "grouped.fprop, grouped.dgrad, grouped.wgrad" in v.message and "linear" not in v.message.split(" for ")[1]
    assert hits(run([*BF16, "mixed_precision.fp8=hybrid"], cap=(9, 0)), "MOE038") == []  # Hopper: all native
    (v,) = hits(run([*FP8, "mixed_precision.fp8_recipe=mxfp8"], cap=(9, 0)), "MOE038")
    assert "every GEMM" in v.message
    # a model without MoE layers has no grouped GEMMs: tensorwise on sm89 is then fully native
    dense = [*FP8, "model.moe_layer_freq=[0,0]", "model.num_layers=2"]
    assert hits(run(dense, cap=(8, 9)), "MOE038") == []


@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)], ids=lambda c: f"sm{c[0]}{c[1]}")
def test_rule_table_is_what_the_run_dispatches(cap: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """MOE038 and trainer/precision read one table: for every recipe, format and capability, the GEMMs
    the rule calls native are exactly those the recipe dispatches to a native kernel."""
    from moectl.core import hardware
    from trainer.precision import native
    from trainer.precision.recipes import FP4_RECIPES, FP8_RECIPES

    monkeypatch.setattr(native, "capability", lambda device: cap)
    for name, cls in {**FP8_RECIPES, **FP4_RECIPES}.items():
        for fmt in ("e4m3", "hybrid") if name in FP8_RECIPES else (None,):
            assert cls(fmt).native_gemms("cuda") == hardware.native_gemms(name, fmt, cap), (name, fmt)
    assert set(hardware.RECIPE_KIND) == {*FP8_RECIPES, *FP4_RECIPES}


def test_cpu_training_emulates_every_recipe() -> None:
    found = hits(
        run(
            [*FP8, "mixed_precision.fp8_recipe=tensorwise", "train.device=cpu", "mixed_precision.emulate=never"],
            cap=(10, 0),
        ),
        "MOE038",
    )
    assert [v.severity for v in found] == ["error"]  # train.device: cpu wins over the capability
    assert "cpu" in found[0].message


@pytest.mark.parametrize(
    "source, name, make",
    [
        ("tokens", "x.bin", ["x.bin"]),
        ("text", "x.txt", ["x.txt"]),
        ("megatron", "prefix", ["prefix.bin", "prefix.idx"]),
        ("megatron", "prefix.idx", ["prefix.bin", "prefix.idx"]),
    ],
)
def test_data_path_exists(tmp_path: Path, source: str, name: str, make: list[str]) -> None:
    sets = [f"data.source={source}", f"data.path={tmp_path / name}", "data.tokenizer=null"]
    found = hits(run(sets), "MOE045")
    assert [v.severity for v in found] == ["warning"]
    assert found[0].keys["data.path"] == str(tmp_path / name)
    for f in make:
        (tmp_path / f).write_bytes(b"\0\0")
    assert hits(run(sets), "MOE045") == []


def test_data_path_with_tilde_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data loader expands `~`; the rule warned "does not exist here" for a file train then read."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "x.bin").write_bytes(b"\0\0")
    assert hits(run(["data.source=tokens", "data.path=~/x.bin"]), "MOE045") == []
    assert len(hits(run(["data.source=tokens", "data.path=~/y.bin"]), "MOE045")) == 1


@pytest.mark.parametrize("source", ["tokens", "text", "megatron"])
def test_data_path_that_is_a_folder_warns(tmp_path: Path, source: str) -> None:
    """A folder exists, so the rule said nothing; train then refused it ("a folder, not a data file")."""
    found = hits(run([f"data.source={source}", f"data.path={tmp_path}"]), "MOE045")
    assert len(found) == 1 and "is a folder" in found[0].message


def test_megatron_prefix_without_its_index_warns(tmp_path: Path) -> None:
    """A `.bin` alone passed (only the .bin was looked for); train reads the .idx first and refused."""
    (tmp_path / "flat.bin").write_bytes(b"\0\0")
    found = hits(run(["data.source=megatron", f"data.path={tmp_path / 'flat'}"]), "MOE045")
    assert len(found) == 1 and f"{tmp_path / 'flat'}.idx does not exist" in found[0].message


def test_megatron_folder_beside_its_pair_is_the_prefix(tmp_path: Path) -> None:
    """`data/` with data.bin and data.idx beside it: the loader reads the pair (the slash goes), so no warning."""
    (tmp_path / "data").mkdir()
    for ext in (".bin", ".idx"):
        (tmp_path / f"data{ext}").write_bytes(b"\0\0")
    assert hits(run(["data.source=megatron", f"data.path={tmp_path / 'data'}/"]), "MOE045") == []


def test_missing_eval_path_warns(tmp_path: Path) -> None:
    (tmp_path / "train.bin").write_bytes(b"\0\0")
    sets = ["data.source=tokens", f"data.path={tmp_path / 'train.bin'}", f"data.eval_path={tmp_path / 'val.bin'}"]
    found = hits(run(sets), "MOE045")
    assert len(found) == 1 and found[0].keys == {"data.source": "tokens", "data.eval_path": str(tmp_path / "val.bin")}


def test_data_path_in_a_folder_this_user_may_not_search_is_left_to_the_data_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Path.exists() raises PermissionError there (Python 3.11): the check ended validate-config in a traceback."""
    real = Path.exists

    def exists(self: Path, *a: Any, **kw: Any) -> bool:
        if self.parent == tmp_path / "locked":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "exists", exists)
    sets = ["data.source=tokens", f"data.path={tmp_path / 'locked' / 'x.bin'}", "data.tokenizer=null"]
    assert hits(run(sets), "MOE045") == []


def test_cpu_threads_on_a_gpu_run_are_not_read() -> None:
    gpu = Environment(te=None, device=Device("cuda", (9, 0), "torch.cuda: NVIDIA H100"), cpus=4)
    assert hits(run(["train.cpu_threads=5"], env=gpu), "MOE072") == []
    assert hits(run(["train.cpu_threads=5"], env=Environment(te=None, device=None, cpus=None)), "MOE072") == []
    # a config for a GPU machine, checked where none is visible
    assert hits(run(["train.cpu_threads=5", "train.device=cuda"]), "MOE072") == []


def test_data_path_ignored_for_builtin_sources() -> None:
    assert hits(run(["data.source=corpus", "data.path=/definitely/not/here"]), "MOE045") == []


def test_several_families_are_all_reported() -> None:
    found = run(
        [
            *FP8,
            "mixed_precision.fp4=e2m1",  # precision: MOE001
            "optimizer.optimizer=muon",
            "mixed_precision.fp4_param_gather=true",  # optimizer: MOE011
            "parallel.overlap_param_gather=true",  # overlap: MOE016
            "parallel.overlap_grad_reduce=false",
            "moe.router_topk=5",  # MoE: MOE018
            "model.num_query_groups=3",  # parallel: MOE032
            "train.cuda_graph=true",  # CUDA graphs: MOE034
            "checkpoint.load_main_params_from_ckpt=true",  # checkpoint: MOE036
            "mixed_precision.emulate=never",  # hardware: MOE038 (sm90)
        ],
        world=3,
        cap=(9, 0),
    )
    ids = {v.rule for v in found}
    assert {"MOE001", "MOE011", "MOE016", "MOE018", "MOE032", "MOE034", "MOE036", "MOE038", "MOE030"} <= ids
    assert [v.rule for v in found] == sorted(v.rule for v in found)  # reported in id order
    assert has_errors(found)


def test_legal_mxfp8_param_gather_with_reuse_and_overlap_is_valid() -> None:
    sets = [
        *MXFP8_GATHER,
        "parallel.overlap_grad_reduce=true",
        "parallel.overlap_param_gather=true",
        "parallel.use_distributed_optimizer=true",
        "parallel.expert_model_parallel_size=2",
        "moe.glu_interleave_size=32",
        "train.global_batch_size=64",
    ]
    assert run(sets, world=8) == []
    for cap in ((9, 0), (10, 0)):  # mxfp8 is emulated on every GPU in this build: a warning, no error
        on_gpu = run(sets, world=8, cap=cap)
        assert not has_errors(on_gpu) and {v.rule for v in on_gpu} == {"MOE038"}
    # the same with Muon is legal too
    assert run([*sets, "optimizer.optimizer=muon"], world=8) == []


def test_warnings_alone_keep_a_config_valid() -> None:
    found = run(["mixed_precision.fp8=e4m3"])  # MOE008 warning only
    assert found and not has_errors(found)


def test_no_rule_crashes_on_zero_sizes() -> None:
    zeros = [f"{k}=0" for k in rules._COUNTS]
    found = run(zeros, world=1)
    reported = {next(iter(v.keys)) for v in hits(found, "MOE041")}
    assert reported == set(rules._COUNTS) - {"model.vocab_size"}  # the corpus feeds bytes: MOE043's
    assert len(hits(found, "MOE043")) == 1
    synthetic = run([*zeros, "data.source=synthetic"], world=1)
    assert {next(iter(v.keys)) for v in hits(synthetic, "MOE041")} == set(rules._COUNTS)


def test_no_rule_crashes_or_hangs_on_sizes_past_64_bits() -> None:
    """`model.num_layers=99999999999999999999` crashed validate-config (OverflowError in `len(range(...))`),
    and 10^8 layers took 39 s to count; the sizes torch cannot take are MOE075's to report, one each."""
    huge = [f"{k}={2**64}" for k in rules._SHAPE_KEYS]
    found = run(huge, world=1)
    assert {next(iter(v.keys)) for v in hits(found, "MOE075")} == set(rules._SHAPE_KEYS)
    assert hits(run([f"model.num_layers={10**8}"], world=1), "MOE075") == []


@pytest.mark.parametrize("huge", [f"train.micro_batch_size={10**400}", f"moe.num_experts={10**400}"])
def test_a_size_past_a_float_is_moe075s_not_a_capacity_crash(huge: str) -> None:
    """Reviews found a 400-digit `train.micro_batch_size` or `moe.num_experts` with a capacity and ep-overlap
    chunks crashing MOE067 (OverflowError turning the capacity's product into a float); MOE075 reports it."""
    found = run([huge, "moe.capacity_factor=2", "moe.pad_expert_input_to_capacity=true",
                 "moe.token_dispatcher=alltoall", "parallel.expert_model_parallel_size=2", "moe.ep_overlap_chunks=2"],
                world=2)  # fmt: skip
    assert hits(found, "MOE075")
    assert not [v for v in hits(found, "MOE067") if "divide each expert's capacity" in v.message]


def test_intervals_past_64_bits_are_not_tensor_sizes() -> None:
    """A huge interval or iteration count trains (a plain Python int): MOE075 leaves it alone."""
    sets = [f"{k}={2**64}" for k in ("train.log_interval", "train.eval_interval", "checkpoint.save_interval")]
    assert hits(run(sets, world=1), "MOE075") == []


@pytest.mark.parametrize("experts", [0, -4])
def test_a_non_positive_expert_count_is_reported_once_not_as_a_topk_range(experts: int) -> None:
    """MOE018 said 'set moe.router_topk to 1..1' for -4 experts; the count is MOE041's to report."""
    found = run([f"moe.num_experts={experts}"], world=1)
    assert hits(found, "MOE041") and not hits(found, "MOE018")


@pytest.mark.parametrize("sets", [["model.vocab_size=0"], ["model.vocab_size=-5"],
                                  ["data.source=text", "data.path=x.txt", "model.vocab_size=0"]])  # fmt: skip
def test_a_vocabulary_below_1_fed_bytes_is_reported_once_with_the_fix_that_works(sets: list[str]) -> None:
    """MOE041 ("set model.vocab_size to an integer >= 1") fired beside MOE043 ("set model.vocab_size >= 256");
    following MOE041's fix left MOE043's error. Only MOE043's fix works: it is the one reported. A source
    with its own tokens (no byte-level floor) still gets MOE041 for a vocabulary below 1."""
    found = run(sets, world=1)
    assert not hits(found, "MOE041"), found
    (byte_level,) = hits(found, "MOE043")
    assert byte_level.fix == "set model.vocab_size >= 256"
    fixed = run([*sets[:-1], "model.vocab_size=256"], world=1)
    assert not hits(fixed, "MOE041") and not hits(fixed, "MOE043")  # that fix alone clears the vocabulary
    for source in (["data.source=synthetic"], ["data.source=text", "data.path=x.txt", "data.tokenizer=t.json"]):
        own_tokens = run([*source, "model.vocab_size=0"], world=1)
        assert [next(iter(v.keys)) for v in hits(own_tokens, "MOE041")] == ["model.vocab_size"]
        assert not hits(own_tokens, "MOE043")


@pytest.mark.parametrize("iters", [0, -5])
def test_an_invalid_train_iters_is_reported_once_not_as_a_short_warmup(iters: int) -> None:
    """MOE015 (warmup >= train_iters) added a warning to MOE041's error about train_iters itself: the user
    fixing the warmup would not have fixed anything. A valid but short run still gets it."""
    found = run([f"train.train_iters={iters}", "optimizer.lr_warmup_iters=10"], world=1)
    assert [next(iter(v.keys)) for v in hits(found, "MOE041")] == ["train.train_iters"]
    assert not hits(found, "MOE015")
    assert hits(run(["train.train_iters=1", "optimizer.lr_warmup_iters=10"], world=1), "MOE015")


@pytest.mark.parametrize("decay", [0, -5])
def test_an_invalid_lr_decay_iters_is_reported_once_not_as_a_long_warmup(decay: int) -> None:
    """MOE014 (warmup not below lr_decay_iters) added an error to MOE041's about lr_decay_iters itself, whose fix
    (shorten the warmup) fixes nothing. A valid lr_decay_iters at or below the warmup still gets it."""
    for warmup in (0, 10):
        found = run([f"optimizer.lr_decay_iters={decay}", f"optimizer.lr_warmup_iters={warmup}"], world=1)
        assert [next(iter(v.keys)) for v in hits(found, "MOE041")] == ["optimizer.lr_decay_iters"]
        assert not hits(found, "MOE014")
    assert hits(run(["optimizer.lr_decay_iters=1", "optimizer.lr_warmup_iters=1"], world=1), "MOE014")


@pytest.mark.parametrize("sets, bad", [(["optimizer.lr=-1e-3"], "lr"), (["optimizer.lr=0"], "lr"),
                                       (["optimizer.min_lr=.inf"], "min_lr"),
                                       (["optimizer.lr=-1e-3", "optimizer.min_lr=-1e-4"], "lr")])  # fmt: skip
def test_an_invalid_lr_is_reported_once_not_as_a_min_lr_above_it(sets: list[str], bad: str) -> None:
    """MOE013 (min_lr above lr) added an error to MOE012's about a negative lr (min_lr 0 is "above" it) or an
    infinite min_lr: its fix (lower min_lr) fixes nothing. A valid min_lr above a valid lr still gets it."""
    found = run(sets, world=1)
    assert f"optimizer.{bad}" in {next(iter(v.keys)) for v in hits(found, "MOE012")}
    assert not hits(found, "MOE013")
    assert hits(run(["optimizer.lr=1e-3", "optimizer.min_lr=1e300"], world=1), "MOE013")


OVERLAP = ["parallel.expert_model_parallel_size=2", "moe.ep_overlap_chunks=3", *DROP_AND_PAD]


@pytest.mark.parametrize("bad, owner", [
    ("moe.num_experts=0", "MOE041"), ("moe.num_experts=-4", "MOE041"), ("train.micro_batch_size=-1", "MOE041"),
    ("model.seq_length=-1", "MOE041"), ("moe.router_topk=-1", "MOE018"), ("moe.capacity_factor=-1.0", "MOE023"),
    ("parallel.expert_model_parallel_size=0", "MOE041"), ("moe.capacity_factor=.inf", "MOE023"),
])  # fmt: skip
def test_an_invalid_value_is_reported_once_not_as_an_ep_overlap_problem(bad: str, owner: str) -> None:
    """MOE067 computed each expert's capacity from values other rules refuse: num_experts=0 was a ZeroDivisionError
    (a traceback from validate-config and train), a negative count or capacity_factor a "capacity of -80 rows"
    to divide, an ep of 0 "no all-to-all to overlap". Those are the value's own rule's errors alone; a valid
    config whose capacity the chunk count does not divide (320 rows, 3 chunks) still gets MOE067."""
    found = run([*OVERLAP, bad], world=2)
    assert hits(found, owner) and not hits(found, "MOE067"), found
    assert "must divide each expert's capacity, 320 rows" in hits(run(OVERLAP, world=2), "MOE067")[0].message


def test_ep_overlap_chunks_divide_the_capacity_a_huge_factor_is_bounded_to() -> None:
    """A finite capacity_factor past every token (1e308 overflowed the product: an OverflowError traceback, then
    no check at all) has the micro-batch's tokens as each expert's capacity, as the dispatcher computes it, so
    MOE067 checks the chunk count against those rows as the first forward would."""
    found = hits(run([*OVERLAP, "moe.capacity_factor=1e308", "train.micro_batch_size=1000"], world=2), "MOE067")
    tokens = 1000 * cfg().model.seq_length
    assert tokens % 3 and len(found) == 1, found
    assert f"capacity, {tokens} rows (the {tokens} tokens of a micro-batch, all an expert can get)" in found[0].message
    assert not hits(run([*OVERLAP, "moe.capacity_factor=1e308", "moe.ep_overlap_chunks=2"], world=2), "MOE067")


def test_world_size_zero_is_reported_not_a_crash() -> None:
    found = run([], world=0)
    assert [(v.rule, v.keys["world_size"]) for v in found] == [("MOE029", 0)]


def test_world_size_defaults_to_ep() -> None:
    # ep=4 alone needs 4 ranks; global 16 = micro 4 x dp 4 fits, 8 experts split 2 per rank
    assert run(["parallel.expert_model_parallel_size=4", "moe.num_experts=8"]) == []
    assert rules.default_world_size(cfg("parallel.expert_model_parallel_size=0")) == 1


def test_parse_version() -> None:
    assert rules.parse_version("2.14.0+cu12") == (2, 14)
    assert rules.parse_version("garbage") is None and rules.parse_version(None) is None


def test_probe_te_without_importing_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(rules.importlib.util, "find_spec", lambda name: None)
    assert rules.probe_te() is None

    pkg = tmp_path / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)

    class Spec:
        submodule_search_locations = [str(pkg)]

    monkeypatch.setattr(rules.importlib.util, "find_spec", lambda name: Spec())
    monkeypatch.setattr(rules.importlib.metadata, "version", lambda dist: "2.14.1")
    assert rules.probe_te() == TEInstall("2.14.1", True)
    (pkg / "pytorch").rmdir()
    assert rules.probe_te() == TEInstall("2.14.1", False)


def test_probe_device_respects_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert rules._nvidia_gpu_nodes() is False


@pytest.mark.skipif(bool(rules.glob.glob("/dev/nvidia[0-9]*")), reason="a GPU is visible: torch is imported on purpose")
def test_validate_path_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "import moectl.cli.app\n"
        "from moectl.core.config.load import load_config\n"
        "from moectl.core.rules import check\n"
        "from moectl.core.summary import summarize\n"
        "cfg = load_config('configs/fp8_tensorwise.yaml', ['moe.backend=te'])\n"
        "check(cfg, world_size=8)\n"
        "summarize(cfg, 8)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformer_engine' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr


def test_probe_device_asks_the_driver_without_importing_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With torch not loaded, the GPU is read off nvidia-smi (the first device CUDA_VISIBLE_DEVICES lets
    through); an unanswering driver means no device, not an error."""
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="9.0, NVIDIA H100 80GB HBM3\n", stderr="")

    monkeypatch.setattr(rules.sys, "modules", {k: v for k, v in sys.modules.items() if k != "torch"})
    monkeypatch.setattr(rules, "_nvidia_gpu_nodes", lambda: True)
    monkeypatch.setattr(rules.subprocess, "run", fake_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert rules.probe_device() == Device("cuda", (9, 0), "nvidia-smi: NVIDIA H100 80GB HBM3")
    assert calls[0][-2:] == ["-i", "3"]

    def broken(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(rules.subprocess, "run", broken)
    assert rules.probe_device() is None


def test_blockwise_param_gather_is_a_clean_config() -> None:
    """Blockwise FP8 param gather is supported (block amaxes all-reduced over dp): no rule refuses it."""
    sets = [*FP8, "mixed_precision.fp8_recipe=blockwise", "mixed_precision.fp8_param_gather=true",
            "model.hidden_size=128", "moe.ffn_hidden_size=128", "model.ffn_hidden_size=128"]  # fmt: skip
    assert [v for v in run(sets, world=2) if v.severity == "error"] == []


# MOE056: the memory estimate against --gpu-memory (a Mixtral-8x7B shape: 92.2 GiB per rank on 8 ranks).
MIXTRAL = REPO / "configs" / "mixtral_8x7b_like.yaml"


def test_memory_estimate_over_the_gpu_warns_and_under_it_does_not() -> None:
    from moectl.core.gpu_memory import parse_gpu_memory

    big = load_config(MIXTRAL)
    found = hits(check(big, 8, env=NO_MACHINE, gpu_memory=parse_gpu_memory("H100")), "MOE056")
    assert [v.severity for v in found] == ["warning"]
    assert "92.2 GiB per rank" in found[0].message and "79.6 GiB" in found[0].message
    assert found[0].keys == {"gpu_memory": "H100 (79.6 GiB)", "world_size": 8}
    assert hits(check(big, 8, env=NO_MACHINE, gpu_memory=parse_gpu_memory("H200")), "MOE056") == []
    assert hits(check(big, 8, env=NO_MACHINE, gpu_memory=parse_gpu_memory("92.3")), "MOE056") == []
    assert hits(check(big, 8, env=NO_MACHINE, gpu_memory=parse_gpu_memory("92.1")), "MOE056") != []
    assert hits(check(big, 8, env=NO_MACHINE), "MOE056") == []  # silent without --gpu-memory


@pytest.mark.parametrize("text, gib", [("80", 80.0), ("79.5GiB", 79.5), ("h100", 81559 / 1024), ("A100-40GB", 40.0)])
def test_gpu_memory_parses_numbers_and_names(text: str, gib: float) -> None:
    from moectl.core.gpu_memory import GIB, parse_gpu_memory

    assert parse_gpu_memory(text).bytes == pytest.approx(gib * GIB, rel=1e-9)


@pytest.mark.parametrize("text", ["0", "-3", "80GB", "H1000", ""])
def test_gpu_memory_refuses_the_rest(text: str) -> None:
    from moectl.core.gpu_memory import parse_gpu_memory

    with pytest.raises(ValueError, match="expected GiB per GPU"):
        parse_gpu_memory(text)


@pytest.mark.parametrize(
    ("grad", "gather", "dist_opt", "dp", "want"),
    [
        (None, None, True, 1, (False, False)),  # one rank: nothing to overlap
        (None, None, True, 4, (True, True)),  # data parallel: both on
        (None, None, False, 4, (True, False)),  # no distributed optimizer: nothing is gathered
        (False, None, True, 4, (False, False)),  # the gather follows an explicit reduce choice
        (None, True, True, 1, (True, True)),  # a set gather turns a null reduce on (MOE016 stays quiet)
        (True, False, True, 4, (True, False)),  # set values win
    ],
)
def test_overlap_policy_resolves_null_by_data_parallel_size(
    grad: bool | None, gather: bool | None, dist_opt: bool, dp: int, want: tuple[bool, bool]
) -> None:
    p = ParallelConfig(overlap_grad_reduce=grad, overlap_param_gather=gather, use_distributed_optimizer=dist_opt)
    assert overlap_policy(p, dp) == want


def test_the_null_overlap_never_trips_the_overlap_rules() -> None:
    """A config that leaves both null validates at every world size, with or without the distributed optimizer."""
    for world in (1, 2, 4):
        for dist_opt in ("true", "false"):
            found = run([f"parallel.use_distributed_optimizer={dist_opt}"], world)
            assert not [v for v in found if v.rule in ("MOE016", "MOE017")], (world, dist_opt, found)


def test_an_eval_path_that_is_a_link_to_the_training_file_is_caught(tmp_path: Path) -> None:
    (tmp_path / "train.bin").write_bytes(b"\0" * 64)
    (tmp_path / "link.bin").symlink_to(tmp_path / "train.bin")
    base = ["data.source=tokens", f"data.path={tmp_path / 'train.bin'}"]
    assert hits(run([*base, f"data.eval_path={tmp_path / 'link.bin'}"]), "MOE052")
    (tmp_path / "val.bin").write_bytes(b"\0" * 64)
    assert not hits(run([*base, f"data.eval_path={tmp_path / 'val.bin'}"]), "MOE052")
