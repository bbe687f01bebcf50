"""Model FLOPs per token and device peaks, for MFU.

MFU counts only useful model FLOPs: matmuls of the active parameters (each token runs top-k of the E
experts, so inactive experts count zero) plus attention scores. Per token, forward + backward:
6 * (active matmul params, output head included, embedding lookup excluded) + 12 * L * S * N * C for
QK^T and AV (PaLM appendix B convention, no causal discount, as Megatron reports it; N * C heads x head dim
is D unless model.kv_channels says otherwise).
"""

from __future__ import annotations

import torch

from moectl.core.config.schema import ModelConfig, MoEConfig
from moectl.core.params import count_params

# Dense (non-sparse) tensor-core peaks in TFLOP/s from NVIDIA's datasheets:
# H100/H200 SXM: bf16 989, fp8 1979 (nvidia.com/en-us/data-center/h100, /h200);
# H100 PCIe: bf16 756, fp8 1513; A100: bf16 312 (no fp8); B200: bf16 2250, fp8 4500.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp8": 1979.0},
    "H100 PCIe": {"bf16": 756.0, "fp8": 1513.0},
    "H100": {"bf16": 989.0, "fp8": 1979.0},
    "A100": {"bf16": 312.0, "fp8": 312.0},
    "B200": {"bf16": 2250.0, "fp8": 4500.0},
}


def peak_tflops(device: torch.device, precision: str = "bf16") -> float | None:
    """The device's dense peak for `precision` ('bf16' or 'fp8'), or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS.items():  # ordered so 'H100 PCIe' wins over 'H100'
        if key in name:
            return peaks.get(precision)
    return None


def flops_per_token(mcfg: ModelConfig, moe_cfg: MoEConfig) -> float:
    """Training FLOPs (forward + backward) per token of the active parameters."""
    matmul = count_params(mcfg, moe_cfg).active_matmul(mcfg.vocab_size, mcfg.hidden_size)
    # scores and the weighted sum: 2 GEMMs of S x (heads * head_dim) per token and layer, forward + backward
    return 6.0 * matmul + 12.0 * mcfg.num_layers * mcfg.seq_length * mcfg.num_attention_heads * mcfg.head_dim
