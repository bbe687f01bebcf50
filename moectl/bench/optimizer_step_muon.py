"""The Muon rows of `moectl bench optimizer-step`: the step a Muon run takes, on the same params as AdamW's.

The params are the bench's `MixShape` in bf16 (a Muon training run's mixed precision: fp32 masters and
grads), wrapped as `moectl train` wraps them with `optimizer: muon` (dp=1): layer-wise Muon for every
matrix (QKV, projection, router, the grouped `[E, out, in]` expert weights), chained with AdamW (fused on
CUDA) for the embedding, the head and the norms. One step is what the loop runs: the joint grad norm and
verdict, Muon's batched Newton-Schulz over the matrices, AdamW over the rest, the write-back of the fp32
masters into the bf16 params. Two rows differ only in the Newton-Schulz dtype (bf16, the GPU default;
fp32, the CPU default and the earlier GPU one); a part row times Muon's update alone (bf16).

Muon's step is compute-bound (Newton-Schulz GEMMs), so its rows carry a FLOP rate, not a bandwidth floor:
`ns_flops` per step (`muon.ns_flops` over every matrix Muon steps, fc1's gate and up halves and QKV's query,
key and value parts apart under the default `optimizer.muon_split_glu` and `muon_split_qkv`) divided by the
row's time, the whole step's time for the step rows (a lower bound on the GEMMs' own rate). `ns_flops` counts
the standard chain's products; where the bf16 rows run the Gram form (`optimizer.muon_ns_method: auto` on the
Triton GEMMs, long side >= 2x the short one) fewer FLOPs are done, so their rate is the chain-equivalent one.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

MUON_STEPS = {"muon_ns_bf16": torch.bfloat16, "muon_ns_fp32": torch.float32}
MUON_PART = "muon update"
MUON_LABELS = {
    "muon_ns_bf16": "moectl Muon + AdamW, bf16 params, Newton-Schulz in bf16",
    "muon_ns_fp32": "moectl Muon + AdamW, bf16 params, Newton-Schulz in fp32",
    MUON_PART: "  Muon step part: update (Newton-Schulz bf16)",
}


def build_muon(shape: Any, device: torch.device, lr: float,
               fill_grads: Callable[[list[torch.Tensor], int], None]) -> tuple[Any, dict[str, Callable[[], object]]]:
    """The Muon + AdamW chain over `shape`'s params (bf16) with random grads; (its Muon member, the timed calls)."""
    from moectl.bench.param_mix import build_params
    from moectl.core.config.schema import OptimizerConfig, ParallelConfig
    from trainer.distributed import DistributedModel
    from trainer.parallel import ParallelState
    from trainer.optim.chained import build_muon_optimizer
    from trainer.optim.muon_routing import muon_model_options

    model = build_params(shape, device, torch.bfloat16, seed=1)
    dm = DistributedModel(model, ParallelConfig(), ParallelState.trivial(device), **muon_model_options(True))
    opt = build_muon_optimizer(dm, OptimizerConfig(optimizer="muon", lr=lr, weight_decay=0.01, clip_grad=1.0))
    fill_grads([b.grad_data for b in dm.buffers], 2)
    muon = opt.members[0]

    def step_in(dtype: torch.dtype) -> Callable[[], object]:
        def step() -> object:
            muon.compute_dtype = dtype
            dm.finish_grad_sync()  # dp=1: no collective; moves the groups to `reduced` as the loop does
            return opt.step(lr)

        return step

    def update() -> None:  # the Muon member's update alone: momentum, batched Newton-Schulz, apply
        muon.compute_dtype = torch.bfloat16
        with torch.no_grad():
            if muon.device_verdict:  # CUDA: the step's update reads the verdict on the device
                muon._update_on_device(lr, muon.grad_verdict())
            else:
                muon._update(lr, 1.0)

    return muon, {**{key: step_in(dt) for key, dt in MUON_STEPS.items()}, MUON_PART: update}


def ns_flops_per_step(muon: Any) -> int:
    """Newton-Schulz FLOPs of one step of `muon` (a `LayerWiseMuon`): every matrix it steps."""
    from trainer.optim.muon import ns_flops

    return sum(ns_flops(shape, muon.cfg.muon_ns_steps) for s in muon.shards for m in s.matrices
               for shape in m.ns_shapes)


def muon_rows(ms: dict[str, float], t_torch: float, flops: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The Muon rows (no byte floor: `None` there) and their notes, from the median times `ms`."""
    rows = []
    for key, label in MUON_LABELS.items():
        rows.append({
            "name": label, "key": key, "ms": ms[key], "bytes_per_param": None, "gbytes": None, "gbps": None,
            "floor_ms": None, "pct_floor": None,
            "throughput_vs_torch": None if key == MUON_PART else t_torch / ms[key],
            "ns_tflops_per_s": flops / (ms[key] * 1e-3) / 1e12,
        })  # fmt: skip
    bf16, fp32 = ms["muon_ns_bf16"], ms["muon_ns_fp32"]
    notes = [
        f"Muon step: {bf16:.3f} ms with Newton-Schulz in bf16 ({bf16 / t_torch:.2f}x torch fused AdamW's time), "
        f"{fp32:.3f} ms in fp32 ({fp32 / bf16:.2f}x the bf16 step); Newton-Schulz {flops / 1e12:.4g} TFLOP a step, "
        f"{flops / (ms[MUON_PART] * 1e-3) / 1e12:.4g} TFLOP/s in the update part alone",
    ]
    return rows, notes
