"""A realistic MoE parameter set for the optimizer and param-gather benchmarks, and their process setup.

`MixShape` describes a GPT-MoE decoder (Megatron-Core names, `[E, out, in]` grouped experts); `build_params`
makes a module holding exactly those parameters on a device, drawn at random (N(0, 0.02); never zeros,
which some kernels run faster on), with `expert_parallel` set on the experts and the gate/up row layout
on the (SwiGLU) fc1 weights as `GroupedMLP` does. No
forward exists: the benchmarks only need the parameters, the buffers the distributed layer lays them out
in, and their grads. `MixShape.default()` has 803.5M parameters (the issue's reference point is 805M): 8
layers of 16 experts (73% of the parameters), GQA attention, an untied 32k vocabulary: its embedding and
head are 16.7% of the parameters, far more than in a real large MoE (Mixtral 8x7B 0.6%, Qwen3-30B-A3B 2%).
`MixShape.large_moe()` (2.0B) has that share at 3.3%: 12 layers of 64 fine-grained experts, a 16k vocab.
`MIXES` names both (the benchmarks' `--mix`).
"""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from moectl.core.facts import GLU_ROWS_ATTR, QKV_ROWS_ATTR, GluRows, QkvRows


@dataclass(frozen=True)
class MixShape:
    """Sizes of the decoder whose parameters are benchmarked."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    experts: int
    expert_ffn: int
    vocab: int

    @staticmethod
    def default() -> "MixShape":
        """803.5M parameters (the issue's reference point for fused AdamW on an H200 is 805M)."""
        return MixShape(layers=8, hidden=2048, heads=16, kv_heads=4, experts=16, expert_ffn=744, vocab=32768)

    @staticmethod
    def quick() -> "MixShape":
        """A few hundred thousand parameters, for CPU smoke tests."""
        return MixShape(layers=2, hidden=64, heads=4, kv_heads=2, experts=4, expert_ffn=64, vocab=256)

    @staticmethod
    def large_moe() -> "MixShape":
        """2.0B parameters whose embedding + head share (3.3%) is a real large MoE's (2-4%): 12 layers of 64
        fine-grained experts x ffn 384 (96% of the parameters), D=2048, an untied 16k vocabulary. Fits an H200
        with the bench's buffers, fp32 grads, masters and moments (~25 GB per rank at dp=2)."""
        return MixShape(layers=12, hidden=2048, heads=16, kv_heads=4, experts=64, expert_ffn=384, vocab=16384)

    @staticmethod
    def large_moe_quick() -> "MixShape":
        """`large_moe`'s proportions at CPU smoke-test size (more experts than layers, a small vocabulary)."""
        return MixShape(layers=2, hidden=64, heads=4, kv_heads=2, experts=8, expert_ffn=32, vocab=64)

    def shapes(self) -> Iterator[tuple[str, tuple[int, ...], bool]]:
        """(name, shape, is_expert) of every parameter, in registration (forward) order."""
        D, hd = self.hidden, self.hidden // self.heads
        yield "embedding.word_embeddings.weight", (self.vocab, D), False
        for i in range(self.layers):
            p = f"decoder.layers.{i}"
            yield f"{p}.input_layernorm.weight", (D,), False
            yield f"{p}.self_attention.linear_qkv.weight", (D + 2 * self.kv_heads * hd, D), False
            yield f"{p}.self_attention.linear_proj.weight", (D, D), False
            yield f"{p}.pre_mlp_layernorm.weight", (D,), False
            yield f"{p}.mlp.router.weight", (self.experts, D), False
            yield f"{p}.mlp.experts.linear_fc1.weight", (self.experts, 2 * self.expert_ffn, D), True
            yield f"{p}.mlp.experts.linear_fc2.weight", (self.experts, D, self.expert_ffn), True
        yield "decoder.final_layernorm.weight", (D,), False
        yield "output_layer.weight", (self.vocab, D), False

    def numel(self) -> int:
        total = 0
        for _, shape, _ in self.shapes():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    def embedding_head_share(self) -> float:
        """The fraction of the parameters in the (untied) embedding and output head: params that stay high
        precision under low-precision param gather, so they bound its gain."""
        return 2 * self.vocab * self.hidden / self.numel()

    def describe(self) -> str:
        return (f"{self.numel() / 1e6:.1f}M params: {self.layers} layers, D={self.hidden}, {self.experts} experts "
                f"x ffn {self.expert_ffn}, vocab {self.vocab} (embedding + head "
                f"{100 * self.embedding_head_share():.1f}%)")  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "numel": self.numel(), "embedding_head_share": self.embedding_head_share()}


#: the benchmarks' `--mix` choices: name -> (full shape, CPU smoke-test shape)
MIXES: dict[str, tuple[Callable[[], MixShape], Callable[[], MixShape]]] = {
    "default": (MixShape.default, MixShape.quick),
    "large-moe": (MixShape.large_moe, MixShape.large_moe_quick),
}


def mix_shape(name: str, quick: bool = False) -> MixShape:
    """The shape of mix `name` (`MIXES`), or its smoke-test size."""
    if name not in MIXES:
        raise ValueError(f"unknown param mix {name!r}; choose one of {sorted(MIXES)}")
    full, small = MIXES[name]
    return small() if quick else full()


def _attach(root: nn.Module, name: str, param: nn.Parameter) -> None:
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, param)


def build_params(shape: MixShape, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """A module holding `shape`'s parameters on `device` in `dtype`, random N(0, 0.02) (norms: 1)."""
    root = nn.Module()
    g = torch.Generator(device=device).manual_seed(seed)
    for name, dims, is_expert in shape.shapes():
        if len(dims) == 1:
            t = torch.ones(dims, device=device, dtype=dtype)
        else:
            t = torch.randn(dims, device=device, dtype=torch.float32, generator=g).mul_(0.02).to(dtype)
        p = nn.Parameter(t)
        if is_expert:
            p.expert_parallel = True  # type: ignore[attr-defined]
        if name.endswith(".linear_fc1.weight"):
            setattr(p, GLU_ROWS_ATTR, GluRows())  # SwiGLU [gate; up] rows (Muon splits them by default)
        if name.endswith(".linear_qkv.weight"):  # Megatron's per-group rows (Muon splits them by default)
            hd = shape.hidden // shape.heads
            setattr(p, QKV_ROWS_ATTR, QkvRows(shape.kv_heads, shape.heads // shape.kv_heads * hd, hd))
        _attach(root, name, p)
    return root


def device_for_rank(requested: str | None) -> torch.device:
    """This process's device: its LOCAL_RANK's GPU when CUDA is there (and not refused), else the CPU."""
    if requested == "cpu" or (requested is None and not torch.cuda.is_available()):
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


class ProcessGroup:
    """Join torchrun's job (NCCL on CUDA, gloo on CPU), or make a one-process world; leave on exit.

    Inside an already initialised default group (tests) it does nothing.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.owned = False
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> "ProcessGroup":
        if dist.is_initialized():
            return self
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=600)
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="moectl-bench-")
            dist.init_process_group(backend, init_method=f"file://{self._tmp.name}/rdzv", rank=0, world_size=1,
                                    timeout=timeout)
        self.owned = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
        if self._tmp is not None:
            self._tmp.cleanup()


def device_meta(device: torch.device) -> dict[str, Any]:
    """Versions and device name for a result's `meta`."""
    meta: dict[str, Any] = {"torch": torch.__version__, "device": device.type}
    if device.type == "cuda":
        meta["device_name"] = torch.cuda.get_device_name(device)
        meta["cuda"] = torch.version.cuda
        v = torch.cuda.nccl.version()
        meta["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    else:
        meta["device_name"] = "cpu"
    meta["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
    return meta


def copy_bandwidth_gbps(device: torch.device, nbytes: int, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written (median of `iters`)."""
    from moectl.bench.timing import median_ms

    n = nbytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, warmup=3, iters=iters)
    return 2 * n * 4 / (ms * 1e-3) / 1e9
