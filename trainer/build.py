"""Build a run's parts from its config: model, engine, data. Each part gets only its own section."""

from __future__ import annotations

import torch

from moectl.core import facts
from moectl.core.config.schema import Config
from trainer.engine import DistributedEngine, Engine, LocalEngine
from trainer.model import GPTMoE
from trainer.parallel import ParallelState
from trainer.precision import Recipe
from trainer.runtime import Runtime


def params_dtype(cfg: Config) -> torch.dtype:
    """bf16 model params under `mixed_precision.bf16` (fp32 masters live in the optimizer), else fp32."""
    return torch.bfloat16 if cfg.mixed_precision.bf16 else torch.float32


def build_model(cfg: Config, device: torch.device, pstate: ParallelState | None = None) -> GPTMoE:
    """The single-device model, initialised from `train.seed` on the CPU, then moved to `device`.

    With expert parallelism (`parallel.expert_model_parallel_size` > 1) its MoE layers hold only this rank's
    experts (their slice of the ep=1 init) and exchange tokens over `pstate.ep`, which is then required.
    """
    ep = cfg.parallel.expert_model_parallel_size
    if ep > 1 and (pstate is None or pstate.ep.size != ep):
        raise ValueError(f"expert_model_parallel_size={ep} needs this rank's ParallelState with an ep group of {ep}")
    recipe = build_recipe(cfg, device)
    if cfg.moe.router_padding_for_quantization and recipe is None:
        # Megatron pads each expert's routings in the router with prob-0 ones; every dispatcher here pads each
        # expert's segment to the recipe's alignment with prob-0 rows (numerically the same, router.py). With
        # no recipe there is nothing to pad to: refused (rule MOE007) rather than accepted and ignored.
        from moectl.core.errors import ConfigError

        raise ConfigError(
            "moe.router_padding_for_quantization", True,
            "pads expert segments to a low-precision recipe's alignment, and the run has no fp8/fp4 recipe (MOE007)",
            "turn on mixed_precision.fp8 or fp4, or set moe.router_padding_for_quantization=false",
        )  # fmt: skip
    model = GPTMoE(
        cfg.model,
        cfg.moe,
        seed=cfg.train.seed,
        params_dtype=params_dtype(cfg),
        gradient_accumulation_fusion=fuses_wgrad(cfg, device),
        recipe=recipe,
        expert_align=recipe.align_size if recipe is not None else 1,
        moe_layer_kwargs={"ep_group": pstate.ep} if ep > 1 and pstate is not None else None,
    )
    return model.to(device)


def fuses_wgrad(cfg: Config, device: torch.device) -> bool:
    """Whether weight grads accumulate into fp32 main_grad inside the GEMMs on `device` (`moectl/core/facts.py`,
    which the rules read too)."""
    return facts.fuses_wgrad(cfg.parallel.gradient_accumulation_fusion, cfg.optimizer.optimizer, device.type)


def build_recipe(cfg: Config, device: torch.device) -> "Recipe | None":
    """The low-precision recipe (None for bf16/fp32), refused here under `emulate: never` if the device
    would run any of its GEMMs emulated (validate-config says so too, as rule MOE038)."""
    from trainer.precision import get_recipe

    recipe = get_recipe(cfg.mixed_precision)
    if recipe is not None:
        recipe.check_device(device)
    return recipe


def build_engine(cfg: Config, model: GPTMoE, rt: Runtime) -> Engine:
    """The optimizer side: contiguous buffers + (distributed) AdamW with fp32 masters, at any world size.

    SGD runs on the one-device `LocalEngine` (torch's optimizer), which has no fp32 masters.
    """
    if cfg.optimizer.optimizer == "sgd":
        if rt.world_size > 1 or cfg.mixed_precision.bf16 or cfg.parallel.gradient_accumulation_fusion:
            from moectl.core.errors import ConfigError

            # rule MOE070 says the same before start-up; this guards callers that build a Trainer directly
            raise ConfigError("optimizer.optimizer", "sgd",
                              "SGD runs on one process with fp32 params and autograd weight grads only (MOE070)",
                              "use optimizer.optimizer=adam, or one process with mixed_precision.bf16=false and "
                              "parallel.gradient_accumulation_fusion=null")  # fmt: skip
        return LocalEngine(model, cfg.optimizer, on_nonfinite=cfg.train.on_nonfinite)
    from trainer.distributed.param_gather import param_gather_storage

    # fp8/fp4 param gather: the recipe's weights stored quantized in the buffers (None: high precision)
    storage = param_gather_storage(model, cfg.mixed_precision, model.recipe)
    return DistributedEngine(model, cfg.parallel, cfg.optimizer, rt.pstate, on_nonfinite=cfg.train.on_nonfinite,
                             storage=storage)


def build_data_for(cfg: Config, rt: Runtime):  # -> (train sampler, eval sampler)
    """Train and held-out samplers for this rank; batches are a pure function of (seed, step, rank)."""
    from trainer.data import Sampler, build_data

    train_src, eval_src = build_data(cfg.data, seq_length=cfg.model.seq_length, vocab_size=cfg.model.vocab_size, seed=cfg.train.seed)
    tc = cfg.train
    common = dict(
        seq_length=cfg.model.seq_length,
        micro_batch_size=tc.micro_batch_size,
        global_batch_size=tc.global_batch_size,
        dp_rank=rt.rank,
        dp_size=rt.world_size,
    )
    return Sampler(train_src, seed=tc.seed, **common), Sampler(eval_src, seed=tc.seed + 1, **common)
