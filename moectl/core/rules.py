"""The rule catalogue: every cross-field rule a config must satisfy, run by `validate-config` and `train`.

`check(cfg, world_size, device_capability, env)` runs every rule and returns every violation (it never
stops at the first). A rule is a small generator function registered with `@rule(...)`: a stable id, a
family, a severity, the keys it reads and a one-line summary; its docstring is the rationale that
`moectl validate-config --explain MOExxx` prints. A rule yields one `_Hit` per problem it finds (a rule
that reads several keys may yield several), and must never raise on a bad value: a divisor that is zero
or negative is skipped there and reported by MOE041 instead (a vocabulary fed bytes: by MOE043, whose fix
is the one that works).

Ids are stable: they are never renumbered or reused, and a new rule takes the next free id whatever its
family. Families and their ids: precision MOE001-009, optimizer and LR schedule MOE010-015, overlap
MOE016-017, MoE MOE018-027, parallel layout MOE028-033, CUDA graphs MOE034-035, checkpoint
MOE036-037, hardware and environment MOE038-040, model, data and training basics MOE041-047, and
later additions: MOE048 (precision: which recipes and optimizers low-precision param gather supports),
MOE049 (precision: fp8_fast_accum_backward needs an fp8 recipe with native GEMMs), MOE050 (retired: it
warned that `train.cuda_graph` was not captured; it is now), MOE051 and MOE052
(data: `data.dtype` / `data.path` / `data.eval_path` only where the source reads them; an eval_path that is the
training file), MOE053 (optimizer: the `muon_*` keys are read only by Muon), MOE054
(hardware: bf16 Newton-Schulz needs sm80+), MOE055 (compile: `train.compile=regional` on the CPU needs the C++
compiler inductor builds with), MOE056 (hardware: the per-rank memory estimate fits the GPU memory given
with `--gpu-memory`), MOE057 (parallel: `parallel.distributed_timeout_minutes` is positive), MOE058-060
(CUDA graphs: one expert-parallel rank or the all-to-all under drop-and-pad, a backend that keeps token
counts on the device, fp32 main grads),
MOE061 (retired: emulated GEMMs under CUDA graphs capture now), MOE062 (moe: what the `te` expert backend
runs: bf16/fp32 or fp8 tensorwise, no fp8/fp4 param gather), MOE063 (hardware: the GEMM widths fit the
native fp8 kernels), MOE064 (CUDA graphs: a dynamic expert-parallel exchange keeps the step eager),
MOE065 (moe: the all-gather dispatcher drops no tokens), MOE066 (retired: CUDA graphs refused expert biases,
whose grads' per-expert sum synced with the host; it no longer does), MOE067 (moe: the overlapped ep exchange,
`ep_overlap_chunks`, needs the all-to-all under drop-and-pad), MOE068 (checkpoint: `run_dir` is not empty),
MOE069 (hardware: `train.device=cuda` checked against a CPU), MOE070 (optimizer: SGD runs on one process, with
fp32 params and autograd weight grads), MOE071 (moe: `defer_expert_wgrad` changes nothing off the fused fp32
wgrad accumulation or with one micro-batch per step), MOE072 (train: `train.cpu_threads` at most the CPUs this
process may use, on a CPU run), MOE073 (train: `train.seed` within the generator's 64 bits), MOE074
(checkpoint: `checkpoint.load` is not an empty string), MOE075 (model: sizes fit torch's 64-bit tensor sizes).

Environment rules (Transformer Engine, device, CPUs) probe lazily and cheaply: TE is looked up through
`importlib.util.find_spec` and package metadata, never imported; torch is imported only when a GPU
looks present (NVIDIA device nodes) or torch is already loaded, so `validate-config` stays fast on a
machine without GPUs. With no GPU visible and no `--device-capability`, hardware rules stay silent:
validating on a login node must not complain about the login node.

Decisions taken here:
- Muon with `moe.single_grouped_weight`: allowed. Megatron silently sends a 3-D expert weight to Adam;
  moectl's Muon orthogonalizes each `[out, in]` expert slice of the `[E, out, in]` parameter with one
  batched Newton-Schulz, which is the same math as per-expert weights, so no rule rejects it.
- Muon with low-precision param gather: only mxfp8 with the reuse buffer (MOE010, MOE011), the one
  path where every rank quantizes the gathered bf16 masters itself, so Muon's updates stay exact.

Megatron-LM argument checks with no moectl rule, and why (numbered as in the survey of Megatron's
`validate_args` this catalogue started from):
- 2 `overlap_param_gather_with_optimizer_step`, 9 `optimizer_cpu_offload`, 17 recompute, 20 and 22
  EP-communication overlap, 23 `save_params_interval`: moectl has none of these options.
- 3 and 6-8 torch-FSDP2, Megatron-FSDP and GTP variants of param gather: moectl has one path, the
  distributed optimizer, so "param gather needs an FSDP or the distributed optimizer" became MOE004.
- 4 "fp4 needs TE >= 2.7", `fp8_param`/`fp4_param`, custom recipes, `first_last_layers_bf16`,
  `fp8_output_proj`: moectl's recipes are its own (native torch GEMMs or exact emulation), not TE's;
  TE is only the optional `te` expert backend (MOE022, MOE062); low-precision storage is implied by param gather.
- 5 (runtime) grouped MXFP8 without the reuse buffer raises in Megatron because of TE's GroupedTensor;
  moectl's staging buffer works either way, so only the memory warning (MOE009) is kept.
- 10 non-Adam optimizers flip the distributed optimizer to layer-wise, checkpoint formats, fp16: moectl
  picks the layer-wise owner itself for Muon, has one checkpoint format and no fp16.
- 11 the decoupled/padded buffer-layout rules of #5479: Megatron buffer internals; the Muon parts that
  carry over are MOE010 and MOE011, and the single-grouped-weight one is decided above.
- 12 TP/SP warning and `moe_grouped_gemm` needs SM80: no tensor parallelism; backend `auto` picks kernels
  the device has. 13, 14, 24, 26 grouped tensor, op fuser, `NVTE_*` variables, "single grouped weight
  needs TE >= 2.14 / only mxfp8": the single grouped `[E, out, in]` layout is moectl's own parameter,
  needing no TE. 15 expert-TP bias rules: no tensor parallelism.
- 16 `moe_router_padding_for_fp8` alias and "router padding not with allgather": a Megatron dispatcher
  limitation; kept: router padding needs a low-precision recipe (MOE007). 18 ncclep/hybridep/flex
  dispatchers: not in moectl.
- 19 CUDA-graph scopes: moectl has one switch (`train.cuda_graph`, one graph per micro-batch), so only "MoE
  needs drop-and-pad" carries over, narrowed (MOE034: bf16 dropless experts have static rows too);
  MOE058-060 are what moectl's capture itself needs.
  21 `delay_wgrad_compute` needs EP-comm overlap and TE versions: TE internals
  (moectl overlaps the delayed expert wgrad with its own dispatcher's all-to-all, trainer/moe/
  delayed_wgrad.py); kept as the warning that it has nothing to overlap without expert parallelism (MOE025).
- 25 `bias_dropout_fusion`, `moe_apply_probs_on_input`, interleave-without-fused-kernel warning: no such
  options, and every moectl backend reads the interleaved layout.
- 27 interleave + expert TP (no TP); TE < 2.17 + CUDA graphs + cached FP8 weights in module GroupedLinear
  (TE #3051): the `te` backend quantizes the weights in every forward and caches none.
"""

from __future__ import annotations

import functools
import glob
import importlib.metadata
import importlib.util
import inspect
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, Optional, Sequence

from moectl.core import hardware
from moectl.core.arith import round_up
from moectl.core.facts import (GATED_ACTIVATIONS, RECIPE_ALIGN, expert_capacity, fc1_rows, fuses_wgrad,
                               megatron_prefix_paths, resolved_expert_backend)
from moectl.core.config.schema import Config, OptimizerConfig
from moectl.core.gpu_memory import GpuMemory
from moectl.core.overlap import overlap_policy
from moectl.core.summary import human_bytes, memory

Severity = Literal["error", "warning"]

#: The `te` expert backend calls TE internals (trainer/moe/backends/te_runtime.py): written against 2.20.2.
TE_MIN_VERSION = (2, 20)
TE_PINNED_VERSION = "2.20.2"
BYTE_LEVEL_VOCAB = 256


@dataclass(frozen=True)
class Violation:
    """One broken rule: which rule, how bad, the keys involved with their values, why, and how to fix it."""

    rule: str
    severity: Severity
    keys: dict[str, Any]
    message: str
    fix: str

    def to_json(self) -> dict[str, Any]:
        """The violation as the JSON object `validate-config --json` prints."""
        return asdict(self)


@dataclass(frozen=True)
class Device:
    """The device a run is checked against: a CUDA GPU of some compute capability, or the CPU."""

    kind: Literal["cpu", "cuda"]
    capability: Optional[tuple[int, int]] = None
    source: str = ""

    @property
    def label(self) -> str:
        """`sm90`, `sm100` or `cpu`."""
        if self.kind == "cpu" or self.capability is None:
            return "cpu"
        return f"sm{self.capability[0]}{self.capability[1]}"

    def describe(self) -> str:
        """The label with where it came from, for messages."""
        return f"{self.label} ({self.source})" if self.source else self.label

    def cuda_before(self, capability: tuple[int, int]) -> bool:
        """A CUDA GPU of known compute capability older than `capability` (e.g. no bf16 tensor cores before
        (8, 0))."""
        return self.kind == "cuda" and bool(self.capability) and self.capability < capability  # type: ignore[operator]


@dataclass(frozen=True)
class TEInstall:
    """An installed Transformer Engine, as its package metadata describes it (it is not imported)."""

    version: Optional[str]
    has_pytorch: bool

    def describe(self) -> str:
        """What was found, for messages."""
        v = self.version or "of unknown version"
        return f"transformer_engine {v}" + ("" if self.has_pytorch else " without its PyTorch part")


_PROBE: Any = object()


class Environment:
    """What this machine offers the rules. Each part is probed lazily, once, unless given.

    `te=None` means "not installed"; `device=None` means "no GPU visible and none given", which keeps the
    hardware rules silent. Tests pass both explicitly to be independent of the machine.
    """

    def __init__(
        self, te: Optional[TEInstall] = _PROBE, device: Optional[Device] = _PROBE, cxx: Optional[str] = _PROBE,
        cpus: Optional[int] = _PROBE,
    ) -> None:
        self._te = te
        self._device = device
        self._cxx = cxx
        self._cpus = cpus

    @functools.cached_property
    def te(self) -> Optional[TEInstall]:
        """The installed Transformer Engine, or None."""
        return probe_te() if self._te is _PROBE else self._te

    @functools.cached_property
    def device(self) -> Optional[Device]:
        """The visible GPU, or None."""
        return probe_device() if self._device is _PROBE else self._device

    @functools.cached_property
    def cpus(self) -> Optional[int]:
        """The CPUs this process may run on (its affinity, as a container or `taskset` limits it), or None."""
        if self._cpus is not _PROBE:
            return self._cpus
        try:
            return len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            return os.cpu_count()

    @functools.cached_property
    def cxx(self) -> Optional[str]:
        """The C++ compiler torch.compile's inductor would build CPU kernels with, or None."""
        return probe_cxx() if self._cxx is _PROBE else self._cxx


def probe_te() -> Optional[TEInstall]:
    """Find Transformer Engine without importing it (importing it takes seconds and touches CUDA)."""
    spec = importlib.util.find_spec("transformer_engine")
    if spec is None:
        return None
    version = None
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    locations = list(spec.submodule_search_locations or [])
    has_pytorch = any((Path(loc) / "pytorch").is_dir() for loc in locations)
    return TEInstall(version=version, has_pytorch=has_pytorch)


def _nvidia_gpu_nodes() -> bool:
    """Whether the NVIDIA driver exposes a GPU to this process (checked without importing torch)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/proc/driver/nvidia/gpus/*"))


def probe_device() -> Optional[Device]:
    """The first visible CUDA GPU, or None, without importing torch: torch's own answer when the process
    has loaded it already, else the driver's (`nvidia-smi`), for the first device CUDA_VISIBLE_DEVICES lets
    through. None when no GPU looks present or the driver cannot be asked."""
    torch = sys.modules.get("torch")
    if torch is not None:
        if not torch.cuda.is_available():
            return None
        cap = torch.cuda.get_device_capability()
        return Device("cuda", (int(cap[0]), int(cap[1])), f"torch.cuda: {torch.cuda.get_device_name()}")
    if not _nvidia_gpu_nodes():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    cmd = ["nvidia-smi", "--query-gpu=compute_cap,name", "--format=csv,noheader"] + (["-i", visible] if visible else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.match(r"\s*(\d+)\.(\d+)\s*,\s*(.+)", out.splitlines()[0] if out.strip() else "")
    return Device("cuda", (int(m.group(1)), int(m.group(2))), f"nvidia-smi: {m.group(3).strip()}") if m else None


def probe_cxx() -> Optional[str]:
    """The path of `$CXX` (else `g++`), the compiler inductor looks for on Linux; None when absent."""
    return shutil.which(os.environ.get("CXX") or "g++")


def parse_version(text: Optional[str]) -> Optional[tuple[int, int]]:
    """`'2.14.0.dev0+abc'` -> (2, 14); None when there is no `major.minor` prefix."""
    m = re.match(r"\s*(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def fmt(value: Any) -> str:
    """A value as a user writes it in YAML (null, true, 3e-4, [1, 0])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value)


class Context:
    """The config plus what the rules derive from it: world size, device, active recipes, layer counts."""

    def __init__(
        self,
        cfg: Config,
        world_size: Optional[int] = None,
        device_capability: Optional[tuple[int, int]] = None,
        env: Optional[Environment] = None,
        gpu_memory: Optional[GpuMemory] = None,
    ) -> None:
        self.cfg = cfg
        self.world_size = world_size if world_size is not None else default_world_size(cfg)
        self.env = env if env is not None else Environment()
        self._capability = device_capability
        self.gpu_memory = gpu_memory  # given with --gpu-memory; None: the memory rule stays silent

    @property
    def dp(self) -> int:
        """Data-parallel size: the world size (no tensor or pipeline parallelism)."""
        return self.world_size

    @functools.cached_property
    def device(self) -> Optional[Device]:
        """The device the run is checked against; None when unknown (hardware rules stay silent)."""
        if self.cfg.train.device == "cpu":
            return Device("cpu", None, "train.device: cpu")
        if self._capability is not None:
            return Device("cuda", self._capability, "--device-capability")
        return self.env.device

    @property
    def recipes(self) -> list[tuple[str, str]]:
        """The active low-precision recipes as (recipe, the key that selects it)."""
        mp = self.cfg.mixed_precision
        out = []
        if mp.fp8 is not None:
            out.append((mp.fp8_recipe, "mixed_precision.fp8_recipe"))
        if mp.fp4 is not None:
            out.append((mp.fp4_recipe, "mixed_precision.fp4_recipe"))
        return out

    @functools.cached_property
    def moe_layers(self) -> int:
        """How many layers are MoE (robust to a malformed `moe_layer_freq`, which MOE026 reports)."""
        m = self.cfg.model
        freq = m.moe_layer_freq
        if isinstance(freq, list):
            return sum(1 for f in freq[: max(m.num_layers, 0)] if f)
        if freq < 1:
            return 0
        return -(-max(m.num_layers, 0) // freq)  # len(range(0, n, freq)), which overflows past 2^63

    @property
    def dense_layers(self) -> int:
        """How many layers have the dense MLP."""
        return max(self.cfg.model.num_layers, 0) - self.moe_layers

    def value(self, key: str) -> Any:
        """The value behind a dotted config key, or a derived pseudo-key (world_size, device, ...)."""
        if key == "world_size":
            return self.world_size
        if key == "device":
            return self.device.describe() if self.device else None
        if key == "transformer_engine":
            te = self.env.te
            return te.describe() if te else "not installed"
        if key == "gpu_memory":
            return self.gpu_memory.label if self.gpu_memory else None
        if key == "cpus":
            return self.env.cpus
        node: Any = self.cfg
        for part in key.split("."):
            node = getattr(node, part)
        return node


def default_world_size(cfg: Config) -> int:
    """The smallest world size that fits: expert_model_parallel_size (1 when that is not positive)."""
    return max(cfg.parallel.expert_model_parallel_size, 1)


@dataclass(frozen=True)
class _Hit:
    """What a rule function yields: the reason, the fix, and optionally its own keys and severity."""

    message: str
    fix: str
    keys: Optional[Sequence[str] | Mapping[str, Any]] = None
    severity: Optional[Severity] = None


RuleFn = Callable[[Context], Iterator[_Hit]]


@dataclass(frozen=True)
class Rule:
    """A registered rule: id, family, default severity, the keys it reads, a summary, its rationale."""

    id: str
    name: str
    family: str
    severity: Severity | Literal["error|warning"]
    keys: tuple[str, ...]
    summary: str
    rationale: str
    fn: RuleFn


RULES: dict[str, Rule] = {}
#: Ids no longer in use (never reused), with why; `validate-config --explain` says so.
RETIRED: dict[str, str] = {
    "MOE050": "it warned that train.cuda_graph was validated but not captured; the trainer captures graphs now "
    "(trainer/graphs), and MOE058-060 say what capture needs",
    "MOE061": "it refused train.cuda_graph with emulated GEMMs (mxfp8, nvfp4, blockwise, fp8 hybrid on Hopper), "
    "whose grouped GEMMs split their token groups by sizes read on the host; under drop-and-pad (which MOE034 "
    "requires of fp8/fp4 experts) the dispatcher now tells the experts their equal rows, nothing is read on "
    "the host, and every recipe replays bitwise like eager (tests/trainer/graphs/test_cuda_graph_gpu.py)",
    "MOE066": "it refused train.cuda_graph with moe.add_bias, whose grads' per-expert sum (torch.segment_reduce) "
    "copied the token counts to the host; on CUDA that sum now reads them on the device (a Triton kernel, "
    "trainer/kernels/segment_sum_triton.py), and bias configs replay bitwise like eager",
}


def rule(id: str, family: str, severity: str, keys: Sequence[str], summary: str) -> Callable[[RuleFn], RuleFn]:
    """Register a rule function; its docstring is the rationale `--explain` prints."""

    def register(fn: RuleFn) -> RuleFn:
        if id in RULES:  # pragma: no cover - a catalogue bug
            raise ValueError(f"duplicate rule id {id}")
        # one line per paragraph, so the terminal (not the source's line breaks) decides the wrapping
        rationale = re.sub(r"(?<!\n)\n(?!\n)", " ", inspect.cleandoc(fn.__doc__ or ""))
        RULES[id] = Rule(id, fn.__name__, family, severity, tuple(keys), summary, rationale, fn)  # type: ignore[arg-type]
        return fn

    return register


#: the pseudo-keys of rules about the machine a check runs on, not the config (`Context.value`)
MACHINE_KEYS = ("device", "transformer_engine", "cpus")


def check(
    cfg: Config,
    world_size: Optional[int] = None,
    device_capability: Optional[tuple[int, int]] = None,
    env: Optional[Environment] = None,
    gpu_memory: Optional[GpuMemory] = None,
) -> list[Violation]:
    """Run every rule on `cfg` and return every violation, in rule-id order.

    `world_size` defaults to the smallest that fits (expert_model_parallel_size). `device_capability`
    checks recipes against that GPU; without it the visible GPU is used, if any. `env` replaces the
    probes of this machine (tests use it). `gpu_memory`: check the memory estimate against it (MOE056).
    """
    ctx = Context(cfg, world_size, device_capability, env, gpu_memory)
    out: list[Violation] = []
    for r in sorted(RULES.values(), key=lambda r: r.id):  # rules sit by family in this file, ids by age
        for hit in r.fn(ctx):
            keys = hit.keys if hit.keys is not None else r.keys
            values = dict(keys) if isinstance(keys, Mapping) else {k: ctx.value(k) for k in keys}
            severity = hit.severity or r.severity
            out.append(Violation(r.id, severity, values, hit.message, hit.fix))  # type: ignore[arg-type]
    return out


def check_elsewhere(cfg: Config, world_size: Optional[int] = None) -> list[Violation]:
    """`check` without the rules about the machine it runs on (its GPU, Transformer Engine, CPUs): for a config
    that trains elsewhere (`ckpt import-hf` writes one) or a checkpoint restored wherever `ckpt validate` runs."""
    violations = check(cfg, world_size=world_size, env=Environment(te=None, device=None))
    return [v for v in violations if not set(MACHINE_KEYS) & set(v.keys)]


def has_errors(violations: Sequence[Violation]) -> bool:
    """Whether any violation is an error (warnings never make a config invalid)."""
    return any(v.severity == "error" for v in violations)


# --------------------------------------------------------------------------------------------- precision


@rule("MOE001", "precision", "error", ["mixed_precision.fp8", "mixed_precision.fp4"], "fp8 and fp4 are exclusive")
def fp8_fp4_exclusive(c: Context) -> Iterator[_Hit]:
    """A linear layer runs one recipe. Turning on both FP8 and FP4 has no defined meaning (Megatron
    rejects it too), so pick one; NVFP4 already keeps sensitive layers in higher precision itself."""
    mp = c.cfg.mixed_precision
    if mp.fp8 is not None and mp.fp4 is not None:
        yield _Hit(
            f"mixed_precision.fp8={fmt(mp.fp8)} and mixed_precision.fp4={fmt(mp.fp4)} are both on",
            "set mixed_precision.fp4=null or mixed_precision.fp8=null",
        )


@rule(
    "MOE002",
    "precision",
    "error",
    ["mixed_precision.fp8_param_gather", "mixed_precision.fp8"],
    "fp8_param_gather needs fp8",
)
def fp8_param_gather_needs_fp8(c: Context) -> Iterator[_Hit]:
    """FP8 param gather stores and all-gathers weights as FP8 with the FP8 recipe's scales. Without an
    FP8 recipe there is nothing to quantize them with."""
    mp = c.cfg.mixed_precision
    if mp.fp8_param_gather and mp.fp8 is None:
        yield _Hit(
            "mixed_precision.fp8_param_gather=true needs mixed_precision.fp8 (e4m3 or hybrid), got null",
            "set mixed_precision.fp8=e4m3, or mixed_precision.fp8_param_gather=false",
        )


@rule(
    "MOE003",
    "precision",
    "error",
    ["mixed_precision.fp4_param_gather", "mixed_precision.fp4"],
    "fp4_param_gather needs fp4",
)
def fp4_param_gather_needs_fp4(c: Context) -> Iterator[_Hit]:
    """FP4 param gather stores and all-gathers weights as NVFP4. Without fp4 there is no FP4 recipe."""
    mp = c.cfg.mixed_precision
    if mp.fp4_param_gather and mp.fp4 is None:
        yield _Hit(
            "mixed_precision.fp4_param_gather=true needs mixed_precision.fp4=e2m1, got null",
            "set mixed_precision.fp4=e2m1, or mixed_precision.fp4_param_gather=false",
        )


@rule(
    "MOE004",
    "precision",
    "error",
    ["mixed_precision.fp8_param_gather", "mixed_precision.fp4_param_gather", "parallel.use_distributed_optimizer"],
    "low-precision param gather needs the distributed optimizer",
)
def param_gather_needs_distributed_optimizer(c: Context) -> Iterator[_Hit]:
    """Param gather means: each rank updates its shard of the fp32 masters, quantizes (or stages) it, and
    all-gathers the result. Without the distributed optimizer there are no shards and no gather: every
    rank holds full masters and would keep low-precision weights with nothing to refresh them from."""
    mp = c.cfg.mixed_precision
    if (mp.fp8_param_gather or mp.fp4_param_gather) and not c.cfg.parallel.use_distributed_optimizer:
        which = "fp8_param_gather" if mp.fp8_param_gather else "fp4_param_gather"
        yield _Hit(
            f"mixed_precision.{which}=true needs parallel.use_distributed_optimizer=true, got false",
            f"set parallel.use_distributed_optimizer=true, or mixed_precision.{which}=false",
        )


@rule(
    "MOE005",
    "precision",
    "error",
    [
        "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag",
        "mixed_precision.fp8_param_gather",
        "mixed_precision.fp8_recipe",
    ],
    "reuse_grad_buf_for_mxfp8_param_ag needs fp8_param_gather and the mxfp8 recipe",
)
def reuse_buffer_needs_mxfp8_param_gather(c: Context) -> Iterator[_Hit]:
    """The reuse buffer stages bf16 masters for the MXFP8 all-gather inside the grad buffer's memory.
    It exists only for MXFP8 param gather: other FP8 recipes gather FP8 bytes with a dp-wide scale and
    need no bf16 staging, and without param gather there is nothing to stage."""
    mp = c.cfg.mixed_precision
    if not mp.reuse_grad_buf_for_mxfp8_param_ag:
        return
    if not mp.fp8_param_gather:
        yield _Hit(
            "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true needs "
            "mixed_precision.fp8_param_gather=true, got false",
            "set mixed_precision.fp8_param_gather=true (with fp8_recipe=mxfp8), or turn the reuse buffer off",
        )
    if mp.fp8_recipe != "mxfp8":
        yield _Hit(
            "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true needs "
            f"mixed_precision.fp8_recipe=mxfp8, got {mp.fp8_recipe}",
            "set mixed_precision.fp8_recipe=mxfp8, or mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=false",
        )


@rule(
    "MOE006",
    "precision",
    "error",
    [
        "model.hidden_size",
        "model.ffn_hidden_size",
        "moe.ffn_hidden_size",
        "mixed_precision.fp8_recipe",
        "mixed_precision.fp4_recipe",
    ],
    "GEMM dimensions are multiples of the recipe's block",
)
def gemm_dims_fit_recipe_block(c: Context) -> Iterator[_Hit]:
    """Quantized GEMMs scale their operands in blocks along both weight dimensions (rowwise for forward,
    columnwise for backward): 16 for fp8 tensorwise/delayed/rowwise (FP8 tensor cores want multiples of
    16), 32 for mxfp8 (one e8m0 scale per 32 values), 128 for blockwise (128x128 tiles), 32 for nvfp4
    (16-value scale blocks; FP4 GEMM kernels want K and N in multiples of 32). A dimension that does not
    divide evenly fails in the kernel, minutes into a job. Only dimensions the model uses are checked:
    model.ffn_hidden_size only when some layer is dense, moe.ffn_hidden_size only when some layer is MoE."""
    dims = ["model.hidden_size"]
    if c.dense_layers > 0:
        dims.append("model.ffn_hidden_size")
    if c.moe_layers > 0:
        dims.append("moe.ffn_hidden_size")
    for recipe, recipe_key in c.recipes:
        block = RECIPE_ALIGN[recipe]
        for key in dims:
            v = c.value(key)
            if v > 0 and v % block:
                up = round_up(v, block)
                yield _Hit(
                    f"{key}={v} is not a multiple of {block}, the block of the {recipe} recipe",
                    f"set {key} to a multiple of {block} (e.g. {up})",
                    keys=(key, recipe_key),
                )


@rule(
    "MOE007",
    "precision",
    "error",
    ["moe.router_padding_for_quantization", "mixed_precision.fp8", "mixed_precision.fp4"],
    "router_padding_for_quantization needs a low-precision recipe",
)
def router_padding_needs_low_precision(c: Context) -> Iterator[_Hit]:
    """Router padding rounds each expert's token count up to the recipe's alignment (16 for FP8, 32 for
    MXFP8/NVFP4) so quantized grouped GEMMs see whole blocks. In bf16/fp32 there is no alignment to meet,
    and the padded routings are pure wasted compute."""
    mp = c.cfg.mixed_precision
    if c.cfg.moe.router_padding_for_quantization and mp.fp8 is None and mp.fp4 is None:
        yield _Hit(
            "moe.router_padding_for_quantization=true but neither mixed_precision.fp8 nor mixed_precision.fp4 is on",
            "set moe.router_padding_for_quantization=false, or turn on an fp8/fp4 recipe",
        )


@rule(
    "MOE008",
    "precision",
    "warning",
    ["mixed_precision.bf16", "mixed_precision.fp8", "mixed_precision.fp4"],
    "fp8/fp4 without bf16",
)
def low_precision_without_bf16(c: Context) -> Iterator[_Hit]:
    """FP8 and FP4 recipes quantize the GEMMs only; everything else (attention, norms, router, embedding,
    unquantized weights, activations between GEMMs) runs in the model's dtype. Low-precision recipes are
    designed and tuned on a bf16 model (Megatron, torchao); with fp32 it works but is slow and uses twice
    the memory for little gain."""
    if c.recipes and not c.cfg.mixed_precision.bf16:
        yield _Hit(
            f"{' and '.join(r for r, _ in c.recipes)} on an fp32 model (mixed_precision.bf16=false)",
            "set mixed_precision.bf16=true",
        )


@rule(
    "MOE009",
    "precision",
    "warning",
    [
        "mixed_precision.fp8_recipe",
        "mixed_precision.fp8_param_gather",
        "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag",
    ],
    "mxfp8 param gather without the reuse buffer costs memory",
)
def mxfp8_param_gather_without_reuse(c: Context) -> Iterator[_Hit]:
    """MXFP8 param gather all-gathers bf16 masters and quantizes them locally (bit-identical to no
    gather). Without `reuse_grad_buf_for_mxfp8_param_ag` the bf16 staging buffer is separate memory, 2
    bytes per weight on every rank; with it the staging lives in the grad buffer, which is idle then."""
    mp = c.cfg.mixed_precision
    if (
        mp.fp8 is not None
        and mp.fp8_recipe == "mxfp8"
        and mp.fp8_param_gather
        and not mp.reuse_grad_buf_for_mxfp8_param_ag
    ):
        yield _Hit(
            "mxfp8 with mixed_precision.fp8_param_gather=true stages bf16 weights in a separate buffer "
            "(reuse_grad_buf_for_mxfp8_param_ag=false)",
            "set mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true",
        )


# ------------------------------------------------------------------------------- optimizer and schedule


@rule(
    "MOE010",
    "optimizer",
    "error",
    [
        "optimizer.optimizer",
        "mixed_precision.fp8_param_gather",
        "mixed_precision.fp8_recipe",
        "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag",
    ],
    "Muon with fp8 param gather only with mxfp8 and the reuse buffer",
)
def muon_fp8_param_gather_needs_mxfp8_reuse(c: Context) -> Iterator[_Hit]:
    """Muon owns whole parameters (layer-wise), so its updated weights must reach the other ranks as
    values every rank can quantize identically. With mxfp8 + the reuse buffer, ranks gather bf16 masters
    and quantize locally: exact. Per-tensor FP8 gather needs one dp-wide amax per tensor from shards
    that Muon does not have, and without the reuse buffer a forced sync can ship stale staging (Megatron
    #4987, #6754). Megatron's proposed rule for layer-wise optimizers is the same."""
    mp = c.cfg.mixed_precision
    if c.cfg.optimizer.optimizer != "muon" or not mp.fp8_param_gather:
        return
    if mp.fp8_recipe != "mxfp8" or not mp.reuse_grad_buf_for_mxfp8_param_ag:
        yield _Hit(
            f"optimizer.optimizer=muon with mixed_precision.fp8_param_gather=true needs fp8_recipe=mxfp8 and "
            f"reuse_grad_buf_for_mxfp8_param_ag=true, got {mp.fp8_recipe} and "
            f"{fmt(mp.reuse_grad_buf_for_mxfp8_param_ag)}",
            "set mixed_precision.fp8_recipe=mxfp8 and mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true, "
            "or mixed_precision.fp8_param_gather=false",
        )


@rule(
    "MOE011",
    "optimizer",
    "error",
    ["optimizer.optimizer", "mixed_precision.fp4_param_gather"],
    "no fp4 param gather with Muon",
)
def muon_no_fp4_param_gather(c: Context) -> Iterator[_Hit]:
    """NVFP4 param gather ships 4-bit values with per-tensor and per-block scales computed across the
    shards; Muon's whole-parameter owners cannot produce them consistently, and re-quantizing orthogonal
    updates to 4 bits every step defeats Muon. Megatron rejects it on the same path (#5479)."""
    if c.cfg.optimizer.optimizer == "muon" and c.cfg.mixed_precision.fp4_param_gather:
        yield _Hit(
            "optimizer.optimizer=muon cannot use mixed_precision.fp4_param_gather=true",
            "set mixed_precision.fp4_param_gather=false (fp4 compute stays), or use optimizer.optimizer=adam",
        )


@rule(
    "MOE012",
    "optimizer",
    "error",
    [
        "optimizer.lr",
        "optimizer.min_lr",
        "optimizer.weight_decay",
        "optimizer.adam_beta1",
        "optimizer.adam_beta2",
        "optimizer.adam_eps",
        "optimizer.clip_grad",
        "optimizer.muon_momentum",
    ],
    "optimizer hyperparameters are in range",
)
def optimizer_hyperparameters_in_range(c: Context) -> Iterator[_Hit]:
    """A learning rate <= 0 or infinite, a beta outside [0, 1), a non-positive or infinite epsilon or a
    negative clip or weight decay is never intended: it diverges, does nothing, or divides by zero. Only the
    values the chosen optimizer reads are checked (Adam's for adam and for Muon's non-matrix params, momentum
    for Muon)."""
    o = c.cfg.optimizer
    checks: list[tuple[str, float, bool, str]] = [
        ("lr", o.lr, 0 < o.lr < math.inf, "> 0 and finite"),
        ("min_lr", o.min_lr, 0 <= o.min_lr < math.inf, ">= 0 and finite"),
        ("weight_decay", o.weight_decay, 0 <= o.weight_decay < math.inf, ">= 0 and finite"),
        ("clip_grad", o.clip_grad, o.clip_grad >= 0, ">= 0 (0 disables clipping)"),
    ]
    if o.optimizer in ("adam", "muon"):
        checks += [
            ("adam_beta1", o.adam_beta1, 0 <= o.adam_beta1 < 1, "in [0, 1)"),
            ("adam_beta2", o.adam_beta2, 0 <= o.adam_beta2 < 1, "in [0, 1)"),
            ("adam_eps", o.adam_eps, 0 < o.adam_eps < math.inf, "> 0 and finite"),
        ]
    if o.optimizer == "muon":
        checks.append(("muon_momentum", o.muon_momentum, 0 <= o.muon_momentum < 1, "in [0, 1)"))
    for name, value, ok, want in checks:
        if not ok:  # also catches NaN, for which every comparison is false
            yield _Hit(
                f"optimizer.{name}={fmt(value)} must be {want}",
                f"set optimizer.{name} {want}",
                keys=(f"optimizer.{name}",),
            )


@rule(
    "MOE070", "optimizer", "error",
    ["optimizer.optimizer", "world_size", "mixed_precision.bf16", "parallel.gradient_accumulation_fusion"],
    "SGD runs on one process, with fp32 params and autograd weight grads",
)  # fmt: skip
def sgd_on_one_process(c: Context) -> Iterator[_Hit]:
    """SGD runs on the one-device engine with torch's optimizer: no fp32 masters (so no bf16 params), no grad
    buffers (so no data parallelism, and no `main_grad` for fused weight grads to add into). Use AdamW or Muon
    for any of those; `gradient_accumulation_fusion: null` already leaves fusion off under SGD."""
    if c.cfg.optimizer.optimizer != "sgd":
        return
    if c.world_size > 1:
        yield _Hit(f"optimizer.optimizer=sgd runs on one process, not {c.world_size}",
                   "use optimizer.optimizer=adam (or muon), or run one process")  # fmt: skip
    if c.cfg.mixed_precision.bf16:
        yield _Hit("optimizer.optimizer=sgd keeps fp32 params: it has no fp32 masters for mixed_precision.bf16=true",
                   "use optimizer.optimizer=adam (or muon), or set mixed_precision.bf16=false")  # fmt: skip
    if c.cfg.parallel.gradient_accumulation_fusion:
        yield _Hit("optimizer.optimizer=sgd has no main_grad buffers for parallel.gradient_accumulation_fusion=true",
                   "set parallel.gradient_accumulation_fusion=null (or false), or use optimizer.optimizer=adam")  # fmt: skip


@rule(
    "MOE071", "moe", "warning",
    ["moe.defer_expert_wgrad", "moe.backend", "parallel.gradient_accumulation_fusion", "mixed_precision.fp8",
     "mixed_precision.fp4", "moe.delay_wgrad_compute", "moe.ep_overlap_chunks", "train.global_batch_size",
     "train.micro_batch_size", "train.device", "optimizer.optimizer", "world_size"],
    "defer_expert_wgrad needs the fused fp32 wgrad accumulation and more than one micro-batch",
)  # fmt: skip
def defer_expert_wgrad_applies(c: Context) -> Iterator[_Hit]:
    """`moe.defer_expert_wgrad` lives in the fused backend's high-precision path that adds the expert weight grads
    into fp32 `main_grad` (trainer/moe/wgrad_deferral.py); elsewhere, or with one micro-batch per step, the flag
    changes nothing (and keeps nothing: no memory is spent)."""
    m = c.cfg.moe
    if not m.defer_expert_wgrad:
        return
    why = []
    # Only `train.device: cpu` counts as CPU here: validate-config often runs off the GPU machine it checks.
    kind = "cpu" if c.cfg.train.device == "cpu" else "cuda"
    if resolved_expert_backend(m.backend, kind) != "fused":
        why.append(f"moe.backend={m.backend}{' on the CPU (grouped)' if m.backend == 'auto' else ''} (only fused defers)")
    fusion = c.cfg.parallel.gradient_accumulation_fusion
    if not fuses_wgrad(fusion, c.cfg.optimizer.optimizer, kind):
        why.append(f"parallel.gradient_accumulation_fusion={fusion} (off here)" if fusion is None
                   else "parallel.gradient_accumulation_fusion=false")  # fmt: skip
    if m.ep_overlap_chunks > 1:
        why.append(f"moe.ep_overlap_chunks={m.ep_overlap_chunks} (chunked expert calls add their own)")
    if c.recipes:
        why.append(f"the {' and '.join(r for r, _ in c.recipes)} recipe (high precision only)")
    if m.delay_wgrad_compute:
        why.append("moe.delay_wgrad_compute=true")
    t = c.cfg.train
    if t.global_batch_size == t.micro_batch_size * c.dp:
        why.append(f"one micro-batch per step (train.global_batch_size={t.global_batch_size})")
    if why:
        yield _Hit(f"moe.defer_expert_wgrad=true changes nothing with {'; '.join(why)}",
                   "set moe.defer_expert_wgrad=false, or change what is listed")  # fmt: skip


@rule("MOE013", "optimizer", "error", ["optimizer.min_lr", "optimizer.lr", "optimizer.lr_decay_style"], "min_lr <= lr")
def min_lr_not_above_lr(c: Context) -> Iterator[_Hit]:
    """The schedule decays from lr to min_lr; a min_lr above the peak makes the "decay" an increase,
    which is always a typo (often a missing minus sign in an exponent). Constant schedules ignore min_lr.
    An lr or min_lr out of its own range (<= 0, negative, infinite) is MOE012's error alone: lowering min_lr
    below a negative lr is not the fix."""
    o = c.cfg.optimizer
    if o.lr_decay_style != "constant" and 0 < o.lr < o.min_lr < math.inf:
        yield _Hit(
            f"optimizer.min_lr={fmt(o.min_lr)} is above optimizer.lr={fmt(o.lr)}",
            "set optimizer.min_lr <= optimizer.lr (e.g. lr / 10)",
        )


@rule(
    "MOE014",
    "optimizer",
    "error",
    ["optimizer.lr_warmup_iters", "optimizer.lr_decay_iters", "optimizer.lr_decay_style"],
    "warmup ends before decay ends",
)
def warmup_before_decay_end(c: Context) -> Iterator[_Hit]:
    """With an explicit lr_decay_iters the decay phase is lr_decay_iters - lr_warmup_iters steps long;
    zero or negative leaves the schedule undefined (Megatron asserts warmup < decay steps too). An
    lr_decay_iters below 1 is MOE041's error alone: the warmup is not what needs fixing there."""
    o = c.cfg.optimizer
    if o.lr_decay_style != "constant" and o.lr_decay_iters is not None and 1 <= o.lr_decay_iters <= o.lr_warmup_iters:
        yield _Hit(
            f"optimizer.lr_warmup_iters={o.lr_warmup_iters} is not below optimizer.lr_decay_iters={o.lr_decay_iters}",
            "make optimizer.lr_warmup_iters smaller than optimizer.lr_decay_iters",
        )


@rule(
    "MOE015", "optimizer", "warning", ["optimizer.lr_warmup_iters", "train.train_iters"], "warmup shorter than the run"
)
def warmup_shorter_than_run(c: Context) -> Iterator[_Hit]:
    """A warmup as long as the run never reaches the peak learning rate. It is legal (a short debug run
    of a long config does it), so it is a warning. A train_iters below 1 is MOE041's error alone: the
    warmup is not what needs fixing there."""
    o, t = c.cfg.optimizer, c.cfg.train
    if o.lr_warmup_iters > 0 and 1 <= t.train_iters <= o.lr_warmup_iters:
        yield _Hit(
            f"optimizer.lr_warmup_iters={o.lr_warmup_iters} >= train.train_iters={t.train_iters}: "
            "lr never reaches its peak",
            "make optimizer.lr_warmup_iters smaller than train.train_iters (a few percent of it is usual)",
        )


# ------------------------------------------------------------------------------------------------ overlap


@rule(
    "MOE016",
    "overlap",
    "error",
    ["parallel.overlap_param_gather", "parallel.overlap_grad_reduce"],
    "overlap_param_gather needs overlap_grad_reduce",
)
def overlap_param_gather_needs_overlap_grad_reduce(c: Context) -> Iterator[_Hit]:
    """Overlapped param gather is driven by the same bucket machinery and hooks as overlapped grad
    reduce: buckets reduce-scatter during backward, and the gather of the next step's params starts from
    the forward pre-hooks. Without overlapped reduce the buckets are never dispatched that way
    (Megatron requires the same)."""
    p = c.cfg.parallel
    grad, gather = overlap_policy(p, c.dp)
    if gather and not grad:
        yield _Hit(
            "parallel.overlap_param_gather=true needs parallel.overlap_grad_reduce=true, got false",
            "set parallel.overlap_grad_reduce=true, or parallel.overlap_param_gather=false",
        )


@rule(
    "MOE017",
    "overlap",
    "error",
    ["parallel.overlap_param_gather", "parallel.use_distributed_optimizer"],
    "overlap_param_gather needs the distributed optimizer",
)
def overlap_param_gather_needs_distributed_optimizer(c: Context) -> Iterator[_Hit]:
    """Only the distributed optimizer shards params and then all-gathers them; without it there is no
    param gather to overlap."""
    p = c.cfg.parallel
    if overlap_policy(p, c.dp)[1] and not p.use_distributed_optimizer:
        yield _Hit(
            "parallel.overlap_param_gather=true needs parallel.use_distributed_optimizer=true, got false",
            "set parallel.use_distributed_optimizer=true, or parallel.overlap_param_gather=false",
        )


# ---------------------------------------------------------------------------------------------------- MoE


@rule("MOE018", "moe", "error", ["moe.router_topk", "moe.num_experts"], "1 <= router_topk <= num_experts")
def router_topk_in_range(c: Context) -> Iterator[_Hit]:
    """Each token goes to k distinct experts: k = 0 routes nowhere, k > E cannot be chosen. A non-positive
    `num_experts` is MOE041's to report (a range 1..-4 would only confuse)."""
    m = c.cfg.moe
    if m.num_experts < 1:
        return
    if not 1 <= m.router_topk <= m.num_experts:
        yield _Hit(
            f"moe.router_topk={m.router_topk} must be between 1 and moe.num_experts={m.num_experts}",
            f"set moe.router_topk to 1..{m.num_experts}",
        )


@rule(
    "MOE019",
    "moe",
    "error",
    ["moe.glu_interleave_size", "moe.activation"],
    "glu_interleave_size needs a gated activation",
)
def interleave_needs_gated_activation(c: Context) -> Iterator[_Hit]:
    """Interleaving reorders fc1's [gate; up] rows into [gate(I), up(I), ...] blocks. A non-gated
    activation (squared_relu) has no gate/up halves, so there is nothing to interleave."""
    m = c.cfg.moe
    if m.glu_interleave_size is not None and m.activation not in GATED_ACTIVATIONS:
        yield _Hit(
            f"moe.glu_interleave_size={m.glu_interleave_size} needs a gated moe.activation "
            f"(swiglu, quick_geglu), got {m.activation}",
            "set moe.glu_interleave_size=null, or moe.activation=swiglu",
        )


@rule(
    "MOE020",
    "moe",
    "error",
    ["moe.glu_interleave_size", "moe.ffn_hidden_size"],
    "glu_interleave_size divides moe.ffn_hidden_size",
)
def interleave_divides_expert_ffn(c: Context) -> Iterator[_Hit]:
    """fc1 holds F gate rows and F up rows; they are stored as F/I pairs of blocks, so I must divide F.
    Megatron does not check this (its own list of missing rules, item 27)."""
    m = c.cfg.moe
    i, f = m.glu_interleave_size, m.ffn_hidden_size
    if i is not None and i > 0 and f > 0 and f % i:
        yield _Hit(
            f"moe.glu_interleave_size={i} does not divide moe.ffn_hidden_size={f}",
            "set moe.glu_interleave_size to a divisor of moe.ffn_hidden_size (e.g. 32), or null",
        )


@rule("MOE021", "moe", "error", ["moe.single_grouped_bias", "moe.add_bias"], "single_grouped_bias needs add_bias")
def single_grouped_bias_needs_add_bias(c: Context) -> Iterator[_Hit]:
    """`single_grouped_bias` chooses how expert biases are stored; without `add_bias` there are none."""
    m = c.cfg.moe
    if m.single_grouped_bias and not m.add_bias:
        yield _Hit(
            "moe.single_grouped_bias=true needs moe.add_bias=true, got false",
            "set moe.add_bias=true, or moe.single_grouped_bias=false",
        )


@rule(
    "MOE022", "moe", "error|warning", ["moe.backend", "transformer_engine"], "backend te needs Transformer Engine 2.20"
)
def te_backend_needs_transformer_engine(c: Context) -> Iterator[_Hit]:
    """The `te` expert backend (trainer/moe/backends/te.py) runs Transformer Engine's grouped GEMMs
    (`general_grouped_gemm`, what `te.GroupedLinear` runs), its row-scaled GLU kernels and its FP8
    current-scaling quantizers. Those are TE internals, written against TE 2.20.2: an older TE or one
    without its PyTorch part is an error, a newer one a warning (the functions may have changed; the GPU
    tests of the backend say whether they did). This is an environment rule: it reports what this machine
    has (found through package metadata, without importing TE, which takes seconds)."""
    if c.cfg.moe.backend != "te":
        return
    te = c.env.te
    want = ".".join(map(str, TE_MIN_VERSION))
    fix = f"install Transformer Engine {TE_PINNED_VERSION} (docs/te_setup.md), or set moe.backend=auto"
    if te is None:
        yield _Hit(f"moe.backend=te needs Transformer Engine >= {want}; found: not installed", fix, severity="error")
        return
    found = parse_version(te.version)
    if found is None or found < TE_MIN_VERSION:
        yield _Hit(f"moe.backend=te needs Transformer Engine >= {want}; found: {te.describe()}", fix, severity="error")
    elif not te.has_pytorch:
        yield _Hit(f"moe.backend=te needs Transformer Engine's PyTorch part; found: {te.describe()}", fix, severity="error")
    elif found > TE_MIN_VERSION:
        yield _Hit(
            f"moe.backend=te was written against Transformer Engine {TE_PINNED_VERSION}; found: {te.describe()}, "
            "whose internal grouped-GEMM and activation functions may differ",
            f"run tests/trainer/moe/backends/test_te_backend_gpu.py on this machine, or install {TE_PINNED_VERSION}",
            severity="warning",
        )


#: What the `te` backend's fp8 path runs: moectl's tensorwise recipe as TE's Float8CurrentScaling.
TE_FP8_RECIPES = ("tensorwise",)


@rule(
    "MOE062",
    "moe",
    "error",
    [
        "moe.backend", "mixed_precision.fp8", "mixed_precision.fp8_recipe", "mixed_precision.fp4",
        "mixed_precision.fp8_param_gather", "mixed_precision.fp4_param_gather",
    ],
    "backend te runs bf16/fp32 or fp8 tensorwise, without param gather",
)  # fmt: skip
def te_backend_precision(c: Context) -> Iterator[_Hit]:
    """The `te` expert backend maps moectl's fp8 `tensorwise` recipe (current per-tensor scaling, one scale
    per expert and token group, E4M3 or E5M2 grads under `hybrid`) onto TE's Float8CurrentScaling
    quantizers, which is the same recipe. The others are not mapped: `delayed` (moectl keeps its own amax
    histories, TE keeps its own), `rowwise` (no TE equivalent), `blockwise`, `mxfp8` and `nvfp4` (TE has
    them, but not checked against moectl's here; mxfp8 and nvfp4 need Blackwell for native TE GEMMs). fp8
    and fp4 param gather publish moectl's own quantized weights, which TE's GEMMs cannot read; the
    backend quantizes the bf16 weights itself in every forward."""
    if c.cfg.moe.backend != "te" or c.moe_layers == 0:
        return
    mp = c.cfg.mixed_precision
    fix = "set moe.backend=fused (every recipe), or mixed_precision.fp8_recipe=tensorwise"
    if mp.fp8 is not None and mp.fp8_recipe not in TE_FP8_RECIPES:
        yield _Hit(
            f"moe.backend=te runs fp8 only as tensorwise (TE's Float8CurrentScaling); got "
            f"mixed_precision.fp8_recipe={mp.fp8_recipe}",
            fix,
            keys=("moe.backend", "mixed_precision.fp8", "mixed_precision.fp8_recipe"),
        )
    if mp.fp4 is not None:
        yield _Hit(
            f"moe.backend=te has no fp4 path; got mixed_precision.fp4={mp.fp4}",
            "set moe.backend=fused, or mixed_precision.fp4=null",
            keys=("moe.backend", "mixed_precision.fp4"),
        )
    for key in ("fp8_param_gather", "fp4_param_gather"):
        if getattr(mp, key):
            yield _Hit(
                f"moe.backend=te with mixed_precision.{key}=true: the gathered weights are moectl's quantized "
                "tensors, which TE's GEMMs cannot read",
                f"set mixed_precision.{key}=false (the te backend quantizes the weights itself), or moe.backend=fused",
                keys=("moe.backend", f"mixed_precision.{key}"),
            )


@rule(
    "MOE023",
    "moe",
    "error",
    ["moe.aux_loss_coeff", "moe.z_loss_coeff", "moe.capacity_factor"],
    "router loss coefficients >= 0, capacity_factor > 0 and finite",
)
def moe_coefficients_in_range(c: Context) -> Iterator[_Hit]:
    """A negative load-balancing or z-loss coefficient rewards imbalance and exploding logits; a capacity
    factor <= 0 gives every expert zero capacity and drops every token."""
    m = c.cfg.moe
    if not m.aux_loss_coeff >= 0:
        yield _Hit(
            f"moe.aux_loss_coeff={fmt(m.aux_loss_coeff)} must be >= 0",
            "set moe.aux_loss_coeff >= 0 (0 disables)",
            keys=("moe.aux_loss_coeff",),
        )
    if not m.z_loss_coeff >= 0:
        yield _Hit(
            f"moe.z_loss_coeff={fmt(m.z_loss_coeff)} must be >= 0",
            "set moe.z_loss_coeff >= 0 (0 disables)",
            keys=("moe.z_loss_coeff",),
        )
    if m.capacity_factor is not None and not 0 < m.capacity_factor < math.inf:
        yield _Hit(
            f"moe.capacity_factor={fmt(m.capacity_factor)} must be > 0 and finite",
            "set moe.capacity_factor > 0 (1.0-1.25 is usual), or null for dropless",
            keys=("moe.capacity_factor",),
        )


@rule(
    "MOE024",
    "moe",
    "error",
    ["moe.pad_expert_input_to_capacity", "moe.capacity_factor"],
    "pad_expert_input_to_capacity needs capacity_factor",
)
def pad_to_capacity_needs_capacity_factor(c: Context) -> Iterator[_Hit]:
    """Padding to capacity pads every expert's input to capacity_factor * T*k/E tokens (at most T); dropless
    routing (capacity_factor null) has no capacity to pad to."""
    m = c.cfg.moe
    if m.pad_expert_input_to_capacity and m.capacity_factor is None:
        yield _Hit(
            "moe.pad_expert_input_to_capacity=true needs moe.capacity_factor, got null",
            "set moe.capacity_factor (e.g. 1.25), or moe.pad_expert_input_to_capacity=false",
        )


@rule(
    "MOE025",
    "moe",
    "warning",
    ["moe.delay_wgrad_compute", "parallel.expert_model_parallel_size"],
    "delay_wgrad_compute has nothing to overlap without expert parallelism",
)
def delay_wgrad_without_expert_parallel(c: Context) -> Iterator[_Hit]:
    """Delaying the expert weight-grad GEMMs exists to hide the expert-parallel all-to-all of the data
    grads behind them. With expert_model_parallel_size 1 there is no all-to-all: the same work runs later,
    and the wgrad inputs live longer (more memory)."""
    if c.cfg.moe.delay_wgrad_compute and c.cfg.parallel.expert_model_parallel_size <= 1:
        yield _Hit(
            "moe.delay_wgrad_compute=true with parallel.expert_model_parallel_size=1: no all-to-all to overlap",
            "set moe.delay_wgrad_compute=false, or use expert parallelism",
        )


@rule("MOE026", "moe", "error", ["model.moe_layer_freq", "model.num_layers"], "moe_layer_freq fits num_layers")
def moe_layer_freq_matches_layers(c: Context) -> Iterator[_Hit]:
    """An int N makes every N-th layer MoE and must be >= 1; a list gives 1 (MoE) or 0 (dense) per layer
    and must have exactly num_layers entries, or layers would silently get the wrong MLP."""
    m = c.cfg.model
    f = m.moe_layer_freq
    if isinstance(f, list):
        if len(f) != m.num_layers:
            yield _Hit(
                f"model.moe_layer_freq has {len(f)} entries but model.num_layers={m.num_layers}",
                "give one 1/0 entry per layer, or an int N (every N-th layer is MoE)",
            )
        if any(v not in (0, 1) for v in f):
            yield _Hit(f"model.moe_layer_freq={fmt(f)} may hold only 1 (MoE) and 0 (dense)", "write 1 or 0 per layer")
    elif f < 1:
        yield _Hit(f"model.moe_layer_freq={f} must be >= 1", "set model.moe_layer_freq=1 (every layer MoE) or N >= 1")


@rule("MOE027", "moe", "warning", ["model.moe_layer_freq", "model.num_layers"], "the model has at least one MoE layer")
def model_has_moe_layer(c: Context) -> Iterator[_Hit]:
    """moectl trains MoE models; a config whose moe_layer_freq selects no layer trains a dense model and
    silently ignores the whole `moe` section, which is rarely what was meant."""
    f = c.cfg.model.moe_layer_freq
    well_formed = len(f) == c.cfg.model.num_layers if isinstance(f, list) else f >= 1
    if well_formed and c.cfg.model.num_layers > 0 and c.moe_layers == 0:
        yield _Hit(
            f"model.moe_layer_freq={fmt(f)} selects no MoE layer: the moe section is unused",
            "mark at least one layer 1",
        )


# ----------------------------------------------------------------------------------------------- parallel


@rule(
    "MOE028",
    "parallel",
    "error",
    ["moe.num_experts", "parallel.expert_model_parallel_size"],
    "num_experts divisible by ep",
)
def experts_divisible_by_ep(c: Context) -> Iterator[_Hit]:
    """Experts are sharded evenly over the expert-parallel ranks; E/ep must be a whole number."""
    e, ep = c.cfg.moe.num_experts, c.cfg.parallel.expert_model_parallel_size
    if e > 0 and ep > 0 and e % ep:
        yield _Hit(
            f"moe.num_experts={e} is not divisible by parallel.expert_model_parallel_size={ep}",
            "make parallel.expert_model_parallel_size a divisor of moe.num_experts",
        )


@rule(
    "MOE029", "parallel", "error", ["world_size", "parallel.expert_model_parallel_size"], "world size divisible by ep"
)
def world_size_divisible_by_ep(c: Context) -> Iterator[_Hit]:
    """The dp = world-size ranks split into expert-parallel groups of ep ranks, each expert replicated
    over dp/ep of them (the expert-data-parallel group); ep must divide the world size (which is >= 1)."""
    ep = c.cfg.parallel.expert_model_parallel_size
    if c.world_size < 1:
        yield _Hit(f"world size {c.world_size} must be >= 1", "check for at least one process (--world-size N)")
    elif ep > 0 and c.world_size % ep:
        yield _Hit(
            f"world size {c.world_size} is not divisible by parallel.expert_model_parallel_size={ep}",
            "run on a multiple of expert_model_parallel_size processes (--world-size / --nproc-per-node), or change ep",
        )


@rule(
    "MOE030",
    "parallel",
    "error",
    ["train.global_batch_size", "train.micro_batch_size", "world_size"],
    "global_batch_size divisible by micro_batch_size x dp",
)
def global_batch_divisible(c: Context) -> Iterator[_Hit]:
    """Each step every one of the dp ranks runs the same number of micro-batches:
    global = micro x dp x accumulation steps, with a whole number of steps."""
    t = c.cfg.train
    per_step = t.micro_batch_size * c.dp
    if per_step > 0 and t.global_batch_size > 0 and t.global_batch_size % per_step:
        yield _Hit(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size={t.micro_batch_size} "
            f"x dp={c.dp} (= {per_step})",
            f"set train.global_batch_size to a multiple of {per_step}",
        )


@rule(
    "MOE031",
    "parallel",
    "error",
    ["model.hidden_size", "model.num_attention_heads", "model.kv_channels"],
    "hidden_size divisible by heads (without kv_channels)",
)
def hidden_divisible_by_heads(c: Context) -> Iterator[_Hit]:
    """Without `model.kv_channels`, attention splits the hidden size into equal heads: head_dim =
    hidden_size / heads. With it, the head dim is its own size (Qwen3-30B-A3B: 2048 hidden, 32 heads of
    128) and the hidden size need not divide."""
    m = c.cfg.model
    if m.kv_channels is None and m.hidden_size > 0 and m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads:
        yield _Hit(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}",
            "make model.num_attention_heads a divisor of model.hidden_size, or set model.kv_channels (the head dim)",
        )


@rule(
    "MOE032",
    "parallel",
    "error",
    ["model.num_attention_heads", "model.num_query_groups"],
    "heads divisible by query groups",
)
def heads_divisible_by_query_groups(c: Context) -> Iterator[_Hit]:
    """Grouped-query attention shares each key/value head among heads/groups query heads."""
    m = c.cfg.model
    g = m.num_query_groups
    if g is not None and g > 0 and m.num_attention_heads > 0 and m.num_attention_heads % g:
        yield _Hit(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by model.num_query_groups={g}",
            "make model.num_query_groups a divisor of model.num_attention_heads (or null)",
        )


@rule(
    "MOE033",
    "parallel",
    "error",
    ["model.hidden_size", "model.num_attention_heads", "model.kv_channels"],
    "head_dim is even (RoPE)",
)
def head_dim_even_for_rope(c: Context) -> Iterator[_Hit]:
    """Rotary embeddings rotate pairs of channels (i, i + head_dim/2); an odd head_dim leaves one out."""
    m = c.cfg.model
    if m.kv_channels is not None:
        if m.kv_channels > 0 and m.kv_channels % 2:
            yield _Hit(f"model.kv_channels={m.kv_channels} (the head dim) is odd", "set an even model.kv_channels "
                       "(64 or 128 is usual)")
    elif m.hidden_size > 0 and m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads == 0:
        hd = m.hidden_size // m.num_attention_heads
        if hd % 2:
            yield _Hit(
                f"head_dim = model.hidden_size={m.hidden_size} / "
                f"model.num_attention_heads={m.num_attention_heads} = {hd} is odd",
                "choose sizes with an even head_dim (64 or 128 is usual)",
            )


# -------------------------------------------------------------------------------------------- CUDA graphs


def device_offset_recipe(cfg: Config) -> bool:
    """Whether the experts' grouped GEMMs read their per-expert row split on the device: bf16/fp16 ones
    (`torch._grouped_mm`), fp8 e4m3 with per-tensor or per-row scales (`torch._scaled_grouped_mm`, every
    pass native), and fp8 hybrid with per-tensor scales (its e5m2 backward in moectl's Triton kernels,
    `hardware.triton_grouped_supports`), at expert dims those kernels take. The others (hybrid rowwise,
    blockwise, mxfp8, fp4) run some grouped GEMM emulated, segment by segment, with the split read on the host."""
    mp = cfg.mixed_precision
    if mp.fp4:
        return False
    if not mp.fp8:
        return True
    # the kernels' shape limits (a GEMM that does not fit runs emulated): torch's grouped fp8 kernel wants
    # the expert dims in multiples of 16, the Triton ones (hybrid's backward) in whole 128-wide tiles
    dims = (cfg.model.hidden_size, cfg.moe.ffn_hidden_size)
    if mp.fp8 == "hybrid":
        tile = hardware.TRITON_GROUPED_TILE
        return mp.fp8_recipe in ("tensorwise", "delayed") and all(d % tile == 0 for d in dims)
    return mp.fp8_recipe in ("tensorwise", "delayed", "rowwise") and all(d % 16 == 0 for d in dims)


def padded_alltoall(cfg: Config) -> bool:
    """Whether the experts' tokens travel by the all-to-all under drop-and-pad, whose split sizes are fixed by
    the config (trainer/moe/dispatch_alltoall.py)."""
    m = cfg.moe
    return m.token_dispatcher == "alltoall" and m.capacity_factor is not None and m.pad_expert_input_to_capacity


def static_token_exchange(cfg: Config) -> bool:
    """Whether the tokens reach their experts without a host sync: one expert-parallel rank, or
    `padded_alltoall`."""
    return cfg.parallel.expert_model_parallel_size <= 1 or padded_alltoall(cfg)


def null_graph_policy(cfg: Config, major: int, *, assume_static_exchange: bool = False) -> bool:
    """Whether `train.cuda_graph: null` captures on a CUDA GPU of compute capability `major`.x: where graphs
    were measured to win and checked bitwise (see `trainer/graphs/capture.py: wants_cuda_graph`).
    `assume_static_exchange`: as if the token exchange were the all-to-all under drop-and-pad (MOE064 asks
    whether that alone would make the step capture)."""
    m, mp = cfg.moe, cfg.mixed_precision
    static = assume_static_exchange or (static_expert_rows(cfg) and static_token_exchange(cfg))
    return (
        major in (9, 10)
        and mp.bf16
        and static
        and m.backend not in ("loop", "te")  # both read the expert row counts on the host (MOE059)
        and not m.delay_wgrad_compute
        and cfg.optimizer.optimizer in ("adam", "muon")  # Muon: 82.7k -> 92.6k tok/s on an H100 (benchmarks.md)
        and not mp.fp4
        # hybrid's e5m2 backward runs in moectl's Triton kernels: 399.7 -> 251.0 ms captured (benchmarks.md)
        and (not mp.fp8 or (mp.fp8 in ("e4m3", "hybrid") and mp.fp8_recipe == "tensorwise"))
    )


def static_expert_rows(cfg: Config) -> bool:
    """Whether every MoE layer's expert input has a row count fixed by the config and a per-expert split the
    GEMMs read on the device (what a CUDA graph needs, MOE034): drop-and-pad (every split is the capacity),
    or dropless experts (T*K routings plus a static bound on the alignment padding) whose recipe's grouped
    GEMMs take device offsets (`device_offset_recipe`). With drops and no padding the dispatcher sizes the
    input with a host sync."""
    m = cfg.moe
    if m.capacity_factor is not None:
        return m.pad_expert_input_to_capacity
    return device_offset_recipe(cfg)


@rule(
    "MOE034",
    "cuda_graph",
    "error",
    ["train.cuda_graph", "moe.capacity_factor", "moe.pad_expert_input_to_capacity", "mixed_precision.fp8",
     "mixed_precision.fp8_recipe", "mixed_precision.fp4"],
    "an MoE model under CUDA graphs needs a static number of expert input rows, split on the device",
)
def cuda_graph_needs_static_expert_rows(c: Context) -> Iterator[_Hit]:
    """A CUDA graph replays fixed shapes and launches with no host syncs. The expert input is static in two
    cases: drop-and-pad (every expert padded to its capacity), and dropless experts, whose rows are the T*K
    routings plus alignment padding bounded by `align - 1` rows per expert (the dispatcher sizes the input
    to the bound: trainer/moe/dispatch.py), split among experts by device-side offsets that the grouped
    GEMMs read on the GPU. A capacity without padding drops a data-dependent number of routings (a host
    sync sizes the input), and a recipe with an emulated grouped GEMM (hybrid rowwise, blockwise, mxfp8,
    fp4) slices each expert's segment at offsets read on the host. (Megatron captures MoE layers
    only with drop-and-pad; moectl's grouped GEMMs take their group offsets on the device, which lifts that
    for dropless bf16 and fp8 e4m3 on sm90/sm100, where `torch._grouped_mm` and `torch._scaled_grouped_mm`
    keep them there. Their fallback for fp32 params and older GPUs reads them on the host: the capture
    then fails with one line naming the place, and `train.cuda_graph: null` does not try.)"""
    m, mp = c.cfg.moe, c.cfg.mixed_precision
    if not c.cfg.train.cuda_graph or c.moe_layers == 0 or static_expert_rows(c.cfg):
        return
    if m.capacity_factor is not None:
        yield _Hit(
            f"train.cuda_graph=true with moe.capacity_factor={fmt(m.capacity_factor)} and "
            "moe.pad_expert_input_to_capacity=false (a data-dependent number of routings is dropped)",
            "set moe.pad_expert_input_to_capacity=true, or moe.capacity_factor=null (dropless), or "
            "train.cuda_graph=false",
        )
    else:
        culprit = (
            f"mixed_precision.fp4={mp.fp4}" if mp.fp4 else f"mixed_precision.fp8={mp.fp8} with fp8_recipe={mp.fp8_recipe}"
        )
        yield _Hit(
            f"train.cuda_graph=true with dropless experts (moe.capacity_factor=null) and {culprit} (a grouped "
            "GEMM of that recipe runs emulated, expert by expert, at row offsets read on the host)",
            "set moe.capacity_factor (e.g. 1.25) and moe.pad_expert_input_to_capacity=true, or use "
            "mixed_precision.fp8_recipe tensorwise or delayed (e4m3 also rowwise), or train.cuda_graph=false",
        )


@rule("MOE035", "cuda_graph", "error", ["train.cuda_graph", "device"], "CUDA graphs need a CUDA device")
def cuda_graph_needs_cuda_device(c: Context) -> Iterator[_Hit]:
    """CUDA graphs capture CUDA kernels; a run on the CPU has none to capture."""
    if c.cfg.train.cuda_graph and c.device is not None and c.device.kind == "cpu":
        yield _Hit(f"train.cuda_graph=true on {c.device.describe()}", "set train.cuda_graph=false, or run on a GPU")


@rule(
    "MOE058",
    "cuda_graph",
    "error",
    ["train.cuda_graph", "parallel.expert_model_parallel_size"],
    "CUDA graphs need one expert-parallel rank, or the all-to-all under drop-and-pad without delayed wgrad",
)
def cuda_graph_needs_local_experts(c: Context) -> Iterator[_Hit]:
    """With expert parallelism a dropless token exchange sizes its all-to-all (or all-gather) from counts
    read on the host, a device-to-host sync that cannot happen inside a captured graph. The all-to-all under
    drop-and-pad is static (every source sends each expert its capacity: `static_token_exchange`), and is
    captured with the micro-batch: the ep collectives inside the graph, on the ep group's own communicator
    (Megatron captures MoE layers under expert parallelism the same way, drop-and-pad only). The dp
    collectives stay outside (trainer/graphs/capture.py). `moe.delay_wgrad_compute` is refused there: its
    async all-to-all and Python flush in the backward were never checked inside a capture."""
    m, ep = c.cfg.moe, c.cfg.parallel.expert_model_parallel_size
    if not c.cfg.train.cuda_graph or c.moe_layers == 0 or ep <= 1:
        return
    if not static_token_exchange(c.cfg):
        why, key = _dynamic_exchange(c.cfg)
        yield _Hit(
            f"train.cuda_graph=true with parallel.expert_model_parallel_size={ep} and {why}: the token exchange "
            "reads its split sizes on the host",
            "set moe.token_dispatcher=alltoall with moe.capacity_factor (e.g. 1.0) and "
            "moe.pad_expert_input_to_capacity=true, or parallel.expert_model_parallel_size=1, or "
            "train.cuda_graph=false",
            keys=("train.cuda_graph", "parallel.expert_model_parallel_size", key),
        )
    elif m.delay_wgrad_compute:
        yield _Hit(
            f"train.cuda_graph=true with parallel.expert_model_parallel_size={ep} and moe.delay_wgrad_compute=true "
            "(its overlap with the all-to-all was never checked inside a capture)",
            "set moe.delay_wgrad_compute=false, or train.cuda_graph=false",
            keys=("train.cuda_graph", "parallel.expert_model_parallel_size", "moe.delay_wgrad_compute"),
        )


def _dynamic_exchange(cfg: Config) -> tuple[str, str]:
    """Why an ep token exchange is not static, and the key that makes it so."""
    m = cfg.moe
    if m.token_dispatcher != "alltoall":
        return f"moe.token_dispatcher={m.token_dispatcher}", "moe.token_dispatcher"
    if m.capacity_factor is None:
        return "dropless experts (moe.capacity_factor=null)", "moe.capacity_factor"
    return "a capacity without moe.pad_expert_input_to_capacity", "moe.pad_expert_input_to_capacity"


@rule("MOE059", "cuda_graph", "error", ["train.cuda_graph", "moe.backend"], "CUDA graphs need a grouped expert backend")
def cuda_graph_needs_grouped_backend(c: Context) -> Iterator[_Hit]:
    """The `loop` backend slices each expert's rows with counts read on the host (a sync a graph cannot
    hold), and so does `te` (Transformer Engine's grouped GEMM takes its per-expert row counts as host
    integers, `m_splits`, as TE's GroupedLinear does); `fused` (what `auto` picks on CUDA) and `grouped`
    keep the counts on the device."""
    backend = c.cfg.moe.backend
    if c.cfg.train.cuda_graph and c.moe_layers > 0 and backend in ("loop", "te"):
        what = "the per-expert loop" if backend == "loop" else "Transformer Engine's grouped GEMM (m_splits)"
        yield _Hit(
            f"train.cuda_graph=true with moe.backend={backend}: {what} reads token counts on the host",
            "set moe.backend=auto (fused on CUDA) or grouped, or train.cuda_graph=false",
        )


@rule(
    "MOE064",
    "cuda_graph",
    "warning",
    ["parallel.expert_model_parallel_size", "moe.token_dispatcher", "moe.capacity_factor",
     "moe.pad_expert_input_to_capacity", "train.cuda_graph", "device"],
    "a dynamic expert-parallel token exchange keeps a step eager that drop-and-pad would capture",
)
def dynamic_ep_exchange_runs_eagerly(c: Context) -> Iterator[_Hit]:
    """Dropless (or all-gather) expert parallelism reads its split sizes on the host in every MoE layer, so
    `train.cuda_graph: null` does not capture it (MOE058) and the step runs eagerly, launch by launch. On 4
    H100s the reference config's ep=4 step was host-bound at 0.47-0.60x of one GPU's tokens/s per GPU, and
    0.857x with the all-to-all under drop-and-pad at capacity 1.0, which captures (docs/benchmarks.md,
    sixteenth session). Drop-and-pad drops the routings over an expert's capacity: a different model, so
    this is a warning, on a known CUDA device only, only where everything else would let `train.cuda_graph:
    null` capture (`null_graph_policy`), and not where graphs are turned off on purpose."""
    ep = c.cfg.parallel.expert_model_parallel_size
    dev = c.device
    if (ep <= 1 or c.moe_layers == 0 or c.cfg.train.cuda_graph is not None or dev is None or dev.kind != "cuda"
            or dev.capability is None or static_token_exchange(c.cfg)
            or not null_graph_policy(c.cfg, dev.capability[0], assume_static_exchange=True)):
        return
    why, key = _dynamic_exchange(c.cfg)
    yield _Hit(
        f"parallel.expert_model_parallel_size={ep} with {why} and train.cuda_graph=null: the token exchange "
        "reads split sizes on the host each layer, so the step runs without a CUDA graph (host-bound on fast GPUs)",
        "for speed, set moe.token_dispatcher=alltoall, moe.capacity_factor=1.0 and "
        "moe.pad_expert_input_to_capacity=true (drops routings over capacity: captured); or set "
        "train.cuda_graph=false to keep this exchange and silence this",
        keys=("parallel.expert_model_parallel_size", key, "train.cuda_graph", "device"),
    )


def _capacity_inputs_valid(c: Context) -> bool:
    """Whether every value an expert's capacity is computed from is in its own range (else another rule's error;
    a token count past int64 is MOE075's, and past a float it would overflow the capacity's product)."""
    m, t = c.cfg.moe, c.cfg.train
    return (1 <= m.num_experts < 2**63 and 1 <= m.router_topk <= m.num_experts and m.capacity_factor is not None
            and 0 < m.capacity_factor < math.inf and t.micro_batch_size >= 1 and c.cfg.model.seq_length >= 1
            and t.micro_batch_size * c.cfg.model.seq_length < 2**63)  # fmt: skip


@rule(
    "MOE067",
    "moe",
    "error",
    ["moe.ep_overlap_chunks", "parallel.expert_model_parallel_size", "moe.token_dispatcher", "moe.capacity_factor",
     "moe.pad_expert_input_to_capacity", "moe.delay_wgrad_compute", "mixed_precision.fp8",
     "mixed_precision.fp8_recipe", "train.micro_batch_size", "model.seq_length"],
    "the overlapped expert-parallel exchange needs the all-to-all under drop-and-pad",
)
def ep_overlap_chunks_needs_static_alltoall(c: Context) -> Iterator[_Hit]:
    """`moe.ep_overlap_chunks` > 1 cuts each expert's padded capacity slots into equal runs, one static
    all-to-all per run each way, so the transfers of one run overlap the expert MLP of the others
    (trainer/moe/dispatch_alltoall.py: dispatch_compute_combine). It needs split sizes fixed by the config
    (the alltoall dispatcher with capacity_factor and pad_expert_input_to_capacity) and more than one ep
    rank (one rank sends nothing), and it does not mix with delay_wgrad_compute, which hides the weight grads
    behind the one backward all-to-all instead, nor with the delayed fp8 recipe, whose amax history assumes
    one quantization per operand and micro-batch (chunks would record n). The chunk count must also divide
    each expert's capacity, ceil(capacity_factor * T * topk / E) but at most T, for the T = micro_batch_size *
    seq_length tokens of a rank's micro-batch (the dispatcher checks it again at its first forward). A value this
    reads that is out of its own range (an ep or a count below 1, a capacity_factor <= 0, a router_topk
    outside 1..num_experts) is that value's rule's error alone (MOE041, MOE023, MOE018): no capacity is
    computed from it (num_experts 0 divided by zero here)."""
    m, ep = c.cfg.moe, c.cfg.parallel.expert_model_parallel_size
    n = m.ep_overlap_chunks
    if n < 1:
        yield _Hit(f"moe.ep_overlap_chunks={n}: must be at least 1", "set moe.ep_overlap_chunks=1 (no chunks) or more")
        return
    if n == 1:
        return
    if ep == 1:
        yield _Hit(f"moe.ep_overlap_chunks={n} with parallel.expert_model_parallel_size={ep}: no all-to-all to overlap",
                   "set moe.ep_overlap_chunks=1, or use expert parallelism")  # fmt: skip
    if not padded_alltoall(c.cfg):
        yield _Hit(
            f"moe.ep_overlap_chunks={n} needs static all-to-all splits: moe.token_dispatcher=alltoall, "
            "moe.capacity_factor and moe.pad_expert_input_to_capacity=true",
            "set those (e.g. moe.capacity_factor=1.0 and moe.pad_expert_input_to_capacity=true), or "
            "moe.ep_overlap_chunks=1",
        )
    elif ep > 1 and _capacity_inputs_valid(c):
        tokens = c.cfg.train.micro_batch_size * c.cfg.model.seq_length
        cap = expert_capacity(m.capacity_factor, tokens, m.router_topk, m.num_experts)
        if cap % n:
            how = (f"the {tokens} tokens of a micro-batch, all an expert can get" if cap == tokens else
                   f"capacity_factor {m.capacity_factor} x {tokens} tokens x topk {m.router_topk} / {m.num_experts} "
                   "experts")  # fmt: skip
            yield _Hit(f"moe.ep_overlap_chunks={n} must divide each expert's capacity, {cap} rows ({how})",
                       f"choose a divisor of {cap}, or moe.ep_overlap_chunks=1")  # fmt: skip
    if m.delay_wgrad_compute:
        yield _Hit(f"moe.ep_overlap_chunks={n} with moe.delay_wgrad_compute=true: two overlaps of one all-to-all",
                   "set moe.delay_wgrad_compute=false, or moe.ep_overlap_chunks=1")  # fmt: skip
    mp = c.cfg.mixed_precision
    if mp.fp8 and mp.fp8_recipe == "delayed":
        yield _Hit(f"moe.ep_overlap_chunks={n} with mixed_precision.fp8_recipe=delayed: the experts would record "
                   f"{n} amaxes per operand and micro-batch", "set moe.ep_overlap_chunks=1, or another fp8_recipe")  # fmt: skip


@rule("MOE068", "checkpoint", "error", ["run_dir"], "run_dir names a folder")
def run_dir_named(c: Context) -> Iterator[_Hit]:
    """An empty `run_dir` (an unset variable in `--run-dir "$RUN"`, say) would put the run's metrics, config
    and checkpoints into whatever folder the command runs in; to train there, say so with `run_dir: .`."""
    if not c.cfg.run_dir.strip():
        yield _Hit(f"run_dir={c.cfg.run_dir!r} is empty", "set run_dir (or --run-dir) to a folder, e.g. runs/NAME")


@rule(
    "MOE065",
    "moe",
    "error",
    ["moe.token_dispatcher", "moe.capacity_factor", "moe.pad_expert_input_to_capacity",
     "parallel.expert_model_parallel_size"],
    "the all-gather dispatcher drops no tokens",
)
def allgather_drops_nothing(c: Context) -> Iterator[_Hit]:
    """Under expert parallelism the all-gather dispatcher sends every rank every token and each rank keeps
    its experts' routings: it has no capacity to drop or pad to (trainer/moe/dispatch_allgather.py refuses
    it when the model is built; this rule says so before any GPU is touched). With one ep rank the local
    dispatcher runs and the capacity applies."""
    m = c.cfg.moe
    if c.cfg.parallel.expert_model_parallel_size > 1 and m.token_dispatcher == "allgather" and (
            m.capacity_factor is not None or m.pad_expert_input_to_capacity):
        yield _Hit(
            f"moe.token_dispatcher=allgather with moe.capacity_factor={fmt(m.capacity_factor)} and "
            f"moe.pad_expert_input_to_capacity={str(m.pad_expert_input_to_capacity).lower()} under "
            f"parallel.expert_model_parallel_size={c.cfg.parallel.expert_model_parallel_size}: it drops no tokens",
            "set moe.token_dispatcher=alltoall, or moe.capacity_factor=null and "
            "moe.pad_expert_input_to_capacity=false",
        )


@rule("MOE060", "cuda_graph", "error", ["train.cuda_graph", "optimizer.optimizer"], "CUDA graphs need fp32 main grads")
def cuda_graph_needs_main_grads(c: Context) -> Iterator[_Hit]:
    """A replayed backward must add into the same grad memory every micro-batch. The distributed engine's
    fp32 `main_grad` buffers are zeroed (or flagged stale, a device flag read inside) outside the graph and
    accumulated into; SGD runs on torch's own
    optimizer, whose `.grad` is assigned by the first micro-batch and added to by the next - the decision a
    graph would bake in at capture (seed 003: grads 200-3000x too small)."""
    if c.cfg.train.cuda_graph and c.cfg.optimizer.optimizer == "sgd":
        yield _Hit(
            "train.cuda_graph=true with optimizer.optimizer=sgd: its grads are assigned on the first micro-batch",
            "set optimizer.optimizer=adam (or muon), or train.cuda_graph=false",
        )


# --------------------------------------------------------------------------------------------- checkpoint


@rule(
    "MOE036",
    "checkpoint",
    "error",
    ["checkpoint.load_main_params_from_ckpt", "checkpoint.load", "checkpoint.no_load_optim"],
    "load_main_params_from_ckpt needs load and no_load_optim",
)
def load_main_params_needs_load_and_no_load_optim(c: Context) -> Iterator[_Hit]:
    """`load_main_params_from_ckpt` takes the fp32 masters from a checkpoint and starts the optimizer
    afresh. It needs a checkpoint to load, and loading the optimizer state as well would contradict it
    (Megatron requires `--no-load-optim` too)."""
    k = c.cfg.checkpoint
    if not k.load_main_params_from_ckpt:
        return
    missing = []
    if not k.load:
        missing.append("checkpoint.load")
    if not k.no_load_optim:
        missing.append("checkpoint.no_load_optim=true")
    if missing:
        yield _Hit(
            f"checkpoint.load_main_params_from_ckpt=true needs {' and '.join(missing)} "
            f"(got load={fmt(k.load)}, no_load_optim={fmt(k.no_load_optim)})",
            "set checkpoint.load to a checkpoint and checkpoint.no_load_optim=true, "
            "or checkpoint.load_main_params_from_ckpt=false",
        )


@rule("MOE037", "checkpoint", "warning", ["checkpoint.no_load_optim", "checkpoint.load"], "no_load_optim without load")
def no_load_optim_without_load(c: Context) -> Iterator[_Hit]:
    """`no_load_optim` changes what is read from `checkpoint.load`; without a checkpoint to load it does
    nothing, which usually means the load path was forgotten."""
    k = c.cfg.checkpoint
    if k.no_load_optim and not k.load:
        yield _Hit(
            "checkpoint.no_load_optim=true has no effect without checkpoint.load",
            "set checkpoint.load, or drop no_load_optim",
        )


# ----------------------------------------------------------------------------------- hardware, environment


@rule(
    "MOE038",
    "hardware",
    "error|warning",
    [
        "mixed_precision.fp8_recipe",
        "mixed_precision.fp4_recipe",
        "mixed_precision.fp8",
        "mixed_precision.emulate",
        "device",
    ],
    "the device runs every GEMM of the recipe natively (else: warning, or error under emulate: never)",
)
def recipe_native_on_device(c: Context) -> Iterator[_Hit]:
    """moectl never pretends: a GEMM the device has no kernel for is emulated exactly (real FP8/FP4 values
    and scales, dequantized, high-precision matmul), which is correct but slow. What runs natively is the
    table in `moectl/core/hardware.py`, the same one the training run dispatches by: per-tensor fp8
    (tensorwise, delayed) and rowwise through `torch._scaled_mm` on sm89+, and the experts' grouped GEMMs
    through `torch._scaled_grouped_mm` on sm90/sm100, e4m3 only, with `fp8: hybrid`'s e5m2 grouped backward in
    moectl's Triton kernels on sm90+ (hybrid rowwise emulates it). blockwise, mxfp8 and nvfp4 are emulated on
    every device in this build;
    a CPU emulates everything. Under `emulate: auto` (or `always`) that is a warning; `emulate: never`
    turns it into an error, as the run would refuse to start. Checked only against a known device: a
    visible GPU, `--device-capability`, or `train.device: cpu`."""
    dev = c.device
    if dev is None:
        return
    never = c.cfg.mixed_precision.emulate == "never"
    families = ("linear", "grouped") if c.moe_layers > 0 else ("linear",)
    cap = dev.capability if dev.kind == "cuda" else None
    for recipe, key in c.recipes:
        fmt = c.cfg.mixed_precision.fp8 if key == "mixed_precision.fp8_recipe" else None
        emulated = hardware.emulated_gemms(recipe, fmt, cap, families)
        if emulated:
            some = "every GEMM" if len(emulated) == 3 * len(families) else ", ".join(emulated)
            yield _Hit(
                f"{key}={recipe}" + (f" (fp8={fmt})" if fmt == "hybrid" else "")
                + f" has no native kernels on {dev.describe()} for {some}: emulated (exact, slow)",
                "for native fp8 use tensorwise, delayed or rowwise with fp8=e4m3 on sm90/sm100 (blockwise, "
                "mxfp8 and nvfp4 are emulated everywhere in this build), or accept emulation"
                + (" with mixed_precision.emulate=auto" if never else ""),
                keys=(key, *(["mixed_precision.fp8"] if fmt == "hybrid" else []), "mixed_precision.emulate", "device"),
                severity="error" if never else "warning",
            )


@rule("MOE039", "hardware", "warning", ["mixed_precision.bf16", "device"], "bf16 needs sm80+")
def bf16_native_on_device(c: Context) -> Iterator[_Hit]:
    """bf16 tensor cores arrived with Ampere (sm80); older GPUs run bf16 GEMMs slowly or not at all."""
    dev = c.device
    if c.cfg.mixed_precision.bf16 and dev is not None and dev.cuda_before((8, 0)):
        yield _Hit(
            f"mixed_precision.bf16=true on {dev.describe()}: no bf16 tensor cores before sm80",
            "run on sm80+ or set bf16=false",
        )


@rule("MOE040", "hardware", "error", ["moe.backend", "device"], "backend te needs a CUDA device")
def te_backend_needs_gpu(c: Context) -> Iterator[_Hit]:
    """Transformer Engine's kernels are CUDA only; on the CPU use backend auto (it picks the reference)."""
    if c.cfg.moe.backend == "te" and c.device is not None and c.device.kind == "cpu":
        yield _Hit(f"moe.backend=te on {c.device.describe()}", "set moe.backend=auto")


Width = tuple[str, int, tuple[str, ...], tuple[str, ...]]  # what, value, the GEMMs it limits, the keys behind it


def _attention_widths(c: Context) -> list[Width]:
    """The dense GEMM widths MOE006 does not check, each with the GEMMs that have it as their K or N (the
    dims `torch._scaled_mm` checks): attention's QKV rows (QKV fprop N, dgrad K), its projection input
    (proj fprop K, dgrad N, wgrad N; with kv_channels unset it is the hidden size, MOE006's), and the tokens of
    a micro-batch (every dense wgrad's K)."""
    m = c.cfg.model
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    head_dim = m.kv_channels or (m.hidden_size // heads if heads > 0 else 0)
    heads_keys = ("model.hidden_size", "model.num_attention_heads", "model.num_query_groups", "model.kv_channels")
    out: list[Width] = [
        ("QKV rows (num_attention_heads + 2 * num_query_groups) * head dim", (heads + 2 * groups) * head_dim,
         ("fprop", "dgrad"), heads_keys),
        ("train.micro_batch_size * model.seq_length", c.cfg.train.micro_batch_size * m.seq_length, ("wgrad",),
         ("train.micro_batch_size", "model.seq_length")),
    ]  # fmt: skip
    if m.kv_channels is not None:
        out.insert(1, ("num_attention_heads * kv_channels", heads * head_dim, ("fprop", "dgrad", "wgrad"),
                       ("model.num_attention_heads", "model.kv_channels")))  # fmt: skip
    return out


def _hybrid_expert_widths(c: Context) -> list[Width]:
    """The expert widths `fp8: hybrid`'s Triton data and weight grads tile by 128, each with the GEMMs it limits:
    the model width (fc1 dgrad N, fc2 dgrad K, fc2 wgrad rows) and the expert ffn width F (fc2 dgrad N; fc1's
    dgrad K and wgrad rows are 2F when gated, so those need only F % 64). Widths that are not multiples of 16
    are MOE006's."""
    m, e = c.cfg.model, c.cfg.moe
    f = e.ffn_hidden_size
    gated = e.activation in GATED_ACTIVATIONS
    ffn_gemms = ("dgrad",) if gated and (2 * f) % hardware.TRITON_GROUPED_TILE == 0 else ("dgrad", "wgrad")
    widths: list[Width] = [
        ("model.hidden_size", m.hidden_size, ("dgrad", "wgrad"), ("model.hidden_size",)),
        ("moe.ffn_hidden_size", f, ffn_gemms, ("moe.ffn_hidden_size", "moe.activation")),
    ]
    return [w for w in widths if w[1] % 16 == 0]


@rule(
    "MOE063",
    "hardware",
    "error|warning",
    ["model.hidden_size", "model.num_attention_heads", "model.num_query_groups", "model.kv_channels",
     "moe.ffn_hidden_size", "moe.activation", "moe.backend", "train.micro_batch_size", "model.seq_length",
     "mixed_precision.fp8", "mixed_precision.fp8_recipe", "mixed_precision.emulate", "device"],
    "the GEMM widths fit the native fp8 kernels (else: warning, or error under emulate: never)",
)
def gemm_dims_fit_native_kernels(c: Context) -> Iterator[_Hit]:
    """A recipe native on the device (MOE038) still runs a GEMM emulated where its widths do not fit the
    kernel: `torch._scaled_mm` takes multiples of 16 (MOE006 checks the model and ffn widths; this rule the
    attention widths and the tokens per micro-batch), and `fp8: hybrid`'s expert data and weight grads (e5m2,
    moectl's Triton kernels, on the backends with grouped GEMMs) take whole 128-wide tiles of the model and
    expert ffn widths. The run would find out at its first GEMM, on the GPU: under `emulate: never` it stops
    there, under `auto` it runs that GEMM emulated (exact, slow). Checked against a known CUDA device only,
    for the GEMMs the recipe runs natively there."""
    dev = c.device
    mp = c.cfg.mixed_precision
    if dev is None or dev.kind != "cuda" or mp.emulate == "always" or mp.fp8 is None:
        return
    never = mp.emulate == "never"
    native = hardware.native_gemms(mp.fp8_recipe, mp.fp8, dev.capability)
    checks = [("linear", 16, _attention_widths(c))]
    if mp.fp8 == "hybrid" and c.moe_layers > 0 and c.cfg.moe.backend in ("auto", "fused", "grouped"):
        # (the loop backend's per-expert GEMMs and te's take multiples of 16)
        checks.append(("grouped", hardware.TRITON_GROUPED_TILE, _hybrid_expert_widths(c)))
    for family, multiple, widths in checks:
        bad = []
        for what, v, gemms, keys in widths:
            hit = [g for g in gemms if native[f"{family}.{g}"]]
            if v > 0 and v % multiple and hit:
                bad.append((what, v, hit, keys))
        if not bad:
            continue
        yield _Hit(
            ", ".join(f"{what}={v} ({'/'.join(hit)})" for what, v, hit, _ in bad)
            + f": not a multiple of {multiple}, so those {family} fp8 GEMMs of mixed_precision.fp8_recipe="
            f"{mp.fp8_recipe} (fp8={mp.fp8}) run emulated on {dev.describe()} (exact, slow)",
            f"make those widths multiples of {multiple}"
            + (" (or use fp8=e4m3, whose expert kernels take multiples of 16)" if family == "grouped" else "")
            + (", or accept emulation with mixed_precision.emulate=auto" if never else ""),
            keys=list(dict.fromkeys(k for *_, keys in bad for k in keys))
            + ["mixed_precision.fp8", "mixed_precision.emulate", "device"],
            severity="error" if never else "warning",
        )


# ------------------------------------------------------------------------------- model, data and training


_COUNTS = (
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.ffn_hidden_size",
    "model.vocab_size",
    "model.seq_length",
    "moe.num_experts",
    "moe.ffn_hidden_size",
    "parallel.expert_model_parallel_size",
    "train.micro_batch_size",
    "train.global_batch_size",
    "train.train_iters",
    "train.log_interval",
)
_OPTIONAL_COUNTS = (  # null = off; checked only when set
    "model.num_query_groups",
    "model.kv_channels",
    "moe.glu_interleave_size",
    "parallel.bucket_size",
    "train.eval_interval",
    "optimizer.lr_decay_iters",
    "checkpoint.save_interval",
    "checkpoint.keep_last",
    "train.cpu_threads",
)
_CONDITIONAL_COUNTS = ("train.eval_iters", "optimizer.muon_ns_steps", "optimizer.lr_warmup_iters")


def _positive_keys(c: Context) -> Iterator[tuple[str, Any, int]]:
    """(key, value, minimum) for every count the run uses."""
    for key in _COUNTS:
        yield key, c.value(key), 1
    for key in _OPTIONAL_COUNTS:
        if c.value(key) is not None:
            yield key, c.value(key), 1
    if c.cfg.train.eval_interval is not None:
        yield "train.eval_iters", c.cfg.train.eval_iters, 1
    if c.cfg.optimizer.optimizer == "muon":
        yield "optimizer.muon_ns_steps", c.cfg.optimizer.muon_ns_steps, 1
    yield "optimizer.lr_warmup_iters", c.cfg.optimizer.lr_warmup_iters, 0


@rule(
    "MOE041",
    "model",
    "error",
    _COUNTS + _OPTIONAL_COUNTS + _CONDITIONAL_COUNTS,
    "sizes, counts and intervals are positive",
)
def sizes_positive(c: Context) -> Iterator[_Hit]:
    """Layer counts, widths, heads, sequence length, vocabulary, experts, batch sizes, iteration counts,
    intervals and `keep_last` must be >= 1 (warmup >= 0): a zero divides by zero or silently disables a
    thing the config says it wants. Optional ones (null = off) are checked only when set. Other rules skip
    a divisor that is not positive and leave the report to this one. The one exception: a vocabulary below 1
    fed bytes is MOE043's alone, whose fix (>= 256) is the one that works; "set it >= 1" only led to MOE043."""
    for key, value, minimum in _positive_keys(c):
        if key == "model.vocab_size" and _byte_level(c.cfg):
            continue  # MOE043 refuses every vocabulary below 256 here, this one included
        if value < minimum:
            yield _Hit(f"{key}={fmt(value)} must be >= {minimum}", f"set {key} to an integer >= {minimum}", keys=(key,))


@rule(
    "MOE042",
    "model",
    "error",
    ["model.init_method_std", "model.norm_epsilon", "model.rotary_base"],
    "init std > 0, norm epsilon > 0, RoPE base > 1",
)
def model_numerics_in_range(c: Context) -> Iterator[_Hit]:
    """A zero init std makes every weight equal (no symmetry breaking); a norm epsilon <= 0 divides by
    zero on a zero row; a RoPE base <= 1 makes frequencies grow with the channel instead of falling."""
    m = c.cfg.model
    for key, value, ok, want in (
        ("model.init_method_std", m.init_method_std, m.init_method_std > 0, "> 0"),
        ("model.norm_epsilon", m.norm_epsilon, m.norm_epsilon > 0, "> 0"),
        ("model.rotary_base", m.rotary_base, m.rotary_base > 1, "> 1 (10000 is usual)"),
    ):
        if not ok:
            yield _Hit(f"{key}={fmt(value)} must be {want}", f"set {key} {want}", keys=(key,))


def _byte_level(cfg: Config) -> bool:
    """Whether the data source feeds raw bytes (ids 0..255) as tokens."""
    return cfg.data.source == "corpus" or (cfg.data.source == "text" and cfg.data.tokenizer is None)


@rule(
    "MOE043",
    "data",
    "error",
    ["model.vocab_size", "data.source", "data.tokenizer"],
    "byte-level sources need vocab_size >= 256",
)
def byte_level_vocab(c: Context) -> Iterator[_Hit]:
    """The built-in corpus, and the text source without a tokenizer, feed raw bytes: token ids 0..255.
    A smaller vocabulary makes the embedding lookup fail on the first batch. A vocabulary below 1 is
    reported here, not by MOE041: only this rule's fix makes the config valid."""
    d, v = c.cfg.data, c.cfg.model.vocab_size
    if _byte_level(c.cfg) and v < BYTE_LEVEL_VOCAB:
        yield _Hit(
            f"data.source={d.source} feeds bytes (ids up to 255) but model.vocab_size={v}",
            f"set model.vocab_size >= {BYTE_LEVEL_VOCAB}",
        )


@rule("MOE044", "data", "error", ["data.source", "data.path"], "tokens, megatron and text sources need data.path")
def data_path_required(c: Context) -> Iterator[_Hit]:
    """The tokens, megatron and text sources read the user's files; only corpus and synthetic need none."""
    d = c.cfg.data
    if d.source in ("tokens", "megatron", "text") and not d.path:
        hint = "the .bin/.idx prefix" if d.source == "megatron" else "the file"
        yield _Hit(f"data.source={d.source} needs data.path, got null", f"set data.path to {hint}")


@rule("MOE045", "data", "warning", ["data.source", "data.path", "data.eval_path"],
      "data.path and data.eval_path name files that exist")  # fmt: skip
def data_path_exists(c: Context) -> Iterator[_Hit]:
    """A missing data file is caught here rather than after the job is scheduled. A warning, not an error:
    configs are often validated on a machine other than the one that has the data. Paths are read as the data
    loader reads them: `~` expanded, a folder is not a data file, and for the megatron source data.path is a
    prefix (or either file of the pair) whose `<prefix>.idx` and `<prefix>.bin` must both exist. A user trial
    found `data.path=~/x.bin` warned as missing (train read it), and a folder, or a Megatron prefix with no
    `.idx`, or a missing data.eval_path, said "valid" for a config that train then refused."""
    d = c.cfg.data
    if d.source not in ("tokens", "megatron", "text"):
        return
    for key, value in (("data.path", d.path), ("data.eval_path", d.eval_path)):
        if not value:
            continue
        try:
            problem = _data_file_problem(d.source, value)
        except OSError:  # a folder this user may not search: the data layer names that, with its reason
            continue
        if problem is not None:
            what, fix = problem
            yield _Hit(f"{key}={value} {what}", fix, keys=("data.source", key))


def _data_file_problem(source: str, value: str) -> Optional[tuple[str, str]]:
    """`(what is wrong, fix)` when the file(s) `source` reads for path `value` are not here, else None.
    Mirrors trainer/data (build.py expands `~`; the Megatron pair of `facts.megatron_prefix_paths`)."""
    path = Path(value).expanduser()
    relative = " (relative paths are from the working directory)" if not path.is_absolute() else ""
    if source != "megatron":
        if path.is_dir():
            return "is a folder, not a data file", f"set it to one {source} file in that folder"
        if not path.exists():
            return "does not exist here", f"check the path{relative}"
        return None
    bin_path, idx_path = megatron_prefix_paths(str(path))
    missing = [f for f in (idx_path, bin_path) if not Path(f).is_file()]
    if not missing:
        return None
    if path.is_dir():
        return ("is a folder, not a Megatron prefix",
                "set it to <folder>/<prefix>, where <prefix>.bin and <prefix>.idx are the pair's files")  # fmt: skip
    if len(missing) == 2:
        return f"names no Megatron pair here ({bin_path} and {idx_path} do not exist)", f"check the prefix{relative}"
    return f"names a Megatron pair without its {missing[0][-4:]} ({missing[0]} does not exist)", \
        "copy both files of the pair (the .bin and .idx from one preprocess_data.py run) next to each other"


@rule("MOE072", "train", "warning", ["train.cpu_threads", "cpus", "device"],
      "train.cpu_threads fits the CPUs of the machine")  # fmt: skip
def cpu_threads_fit(c: Context) -> Iterator[_Hit]:
    """More torch threads than CPUs make them take turns at every parallel op: `train.cpu_threads=1000` on a
    2-CPU machine ran the tiny model at 174 tokens/s instead of about 30,000 (a user trial). Only CPU runs read
    the key; a run on a GPU ignores it."""
    threads, cpus = c.cfg.train.cpu_threads, c.env.cpus
    if threads is None or cpus is None or threads <= cpus or c.cfg.train.device == "cuda":
        return
    if c.device is not None and c.device.kind != "cpu":
        return
    yield _Hit(f"train.cpu_threads={threads} is more than the {cpus} CPUs this process may use",
               f"set train.cpu_threads to at most {cpus} (null: OMP_NUM_THREADS, else 1)")  # fmt: skip


#: torch's generator takes a seed in [-2^63, 2^64)
SEED_RANGE = (-(2**63), 2**64 - 1)


@rule("MOE073", "train", "error", ["train.seed"], "train.seed fits the random generator")
def seed_fits(c: Context) -> Iterator[_Hit]:
    """torch's generator takes a 64-bit seed: `train.seed=18446744073709551616` (2^64) passed validate-config,
    then every rank died in `torch.manual_seed` with "Overflow when unpacking long long" (a user trial)."""
    lo, hi = SEED_RANGE
    seed = c.cfg.train.seed
    if not lo <= seed <= hi:
        yield _Hit(f"train.seed={seed} is outside the generator's range [-2^63, 2^64 - 1]",
                   "set train.seed to a smaller integer (any value there is as good a seed)")


#: the largest size torch takes: a tensor's dimensions and its storage's byte count are signed 64-bit integers
INT64_MAX = 2**63 - 1
_MAX_ELEMENT_BYTES = 8  # the widest element a run's tensors hold (int64 indices; fp32 states are 4)


def _tensor_sizes(c: Context) -> Iterator[tuple[str, tuple[str, ...], int]]:
    """(what, the keys behind it, its element count) for the model's largest tensors of each shape kind: the
    parameters the run allocates at start-up and the per-micro-batch activations and logits."""
    m, moe, mbs = c.cfg.model, c.cfg.moe, c.cfg.train.micro_batch_size
    d, v, s, heads, head_dim = m.hidden_size, m.vocab_size, m.seq_length, m.num_attention_heads, m.head_dim
    yield "the embedding [vocab_size, hidden_size]", ("model.vocab_size", "model.hidden_size"), v * d
    yield ("the QKV weight [(heads + 2 x query groups) x head dim, hidden_size]",
           ("model.num_attention_heads", "model.num_query_groups", "model.kv_channels", "model.hidden_size"),
           (heads + 2 * m.kv_heads) * head_dim * d)  # fmt: skip
    if c.dense_layers > 0:
        yield "a dense fc1 [2 x ffn_hidden_size, hidden_size]", ("model.ffn_hidden_size", "model.hidden_size"), \
            2 * m.ffn_hidden_size * d
    if c.moe_layers > 0:
        yield ("the experts' fc1 [num_experts, fc1 rows, hidden_size]",
               ("moe.num_experts", "moe.ffn_hidden_size", "model.hidden_size"),
               moe.num_experts * fc1_rows(moe.activation, moe.ffn_hidden_size) * d)
    yield "the RoPE table [seq_length, head dim]", ("model.seq_length", "model.kv_channels", "model.hidden_size"), \
        s * head_dim
    yield ("a micro-batch's logits [micro_batch_size, seq_length, vocab_size]",
           ("train.micro_batch_size", "model.seq_length", "model.vocab_size"), mbs * s * v)
    yield ("a micro-batch's activations [micro_batch_size, seq_length, hidden_size]",
           ("train.micro_batch_size", "model.seq_length", "model.hidden_size"), mbs * s * d)


#: the sizes that become tensor dimensions (intervals and iteration counts are plain Python ints: any will do)
_SHAPE_KEYS = (
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.num_query_groups",
    "model.kv_channels",
    "model.ffn_hidden_size",
    "model.vocab_size",
    "model.seq_length",
    "moe.num_experts",
    "moe.ffn_hidden_size",
    "moe.glu_interleave_size",
    "train.micro_batch_size",
)


@rule("MOE075", "model", "error", _SHAPE_KEYS, "model sizes fit torch's 64-bit tensor sizes")
def sizes_fit_int64(c: Context) -> Iterator[_Hit]:
    """torch sizes tensors with signed 64-bit integers. `model.seq_length=10**29` (written out), or
    `model.vocab_size` or `moe.num_experts` past 2^63, passed validate-config, then `train` died with a
    traceback ("int too big to convert", "Overflow when unpacking long long"), and `model.num_layers` past
    2^63 crashed validate-config itself. Each size that becomes a tensor dimension must be at most 2^63 - 1;
    then the byte size of the model's largest tensors (products of those sizes: 10^10 x 10^10 for the
    embedding overflows although both fit) must fit too, at up to 8 bytes an element (torch sizes a tensor's
    storage in bytes: a vocabulary of 2^55 x 64 fp32 elements failed "Storage size calculation overflowed"). Intervals and iteration counts are not tensor sizes,
    and any of them will do. A size that fits but not in memory is a failure of the run (out of memory), not
    this rule's: `--gpu-memory` checks the estimate against a GPU (MOE056). Sizes below 1 are MOE041's."""
    big = False
    for key in _SHAPE_KEYS:
        value = c.value(key)
        if value is not None and value > INT64_MAX:
            big = True
            yield _Hit(f"{key}={value} is past 2^63 - 1, the largest size torch takes",
                       f"set {key} to a realistic size (at most {INT64_MAX})", keys=(key,))
    if big or any(v is not None and v < 1 for v in map(c.value, _SHAPE_KEYS)):
        return  # the products of an oversized or non-positive size say nothing more
    for what, keys, numel in _tensor_sizes(c):
        if numel * _MAX_ELEMENT_BYTES > INT64_MAX:
            yield _Hit(f"{what} would hold {numel:.3g} elements, past 2^63 - 1 bytes at {_MAX_ELEMENT_BYTES} bytes "
                       "each, the most a torch tensor holds",
                       f"make {' or '.join(k for k in keys if c.value(k) is not None)} smaller",
                       keys=tuple(k for k in keys if c.value(k) is not None))


@rule("MOE074", "checkpoint", "error", ["checkpoint.load"], "checkpoint.load names a checkpoint")
def load_named(c: Context) -> Iterator[_Hit]:
    """An empty `checkpoint.load` (an unset variable in `--set checkpoint.load=$CK`, say) trained from scratch
    without a word; null is how a config says "start fresh"."""
    load = c.cfg.checkpoint.load
    if load is not None and not str(load).strip():
        yield _Hit(f"checkpoint.load={load!r} is empty",
                   "set checkpoint.load to a checkpoints folder or a step folder, or null to start fresh")


@rule("MOE046", "data", "warning", ["data.tokenizer", "data.source"], "data.tokenizer is used only by the text source")
def tokenizer_only_for_text(c: Context) -> Iterator[_Hit]:
    """Only the text source tokenizes; the others read token ids (or bytes), so a tokenizer set elsewhere
    is silently ignored, which usually means the wrong source was chosen."""
    d = c.cfg.data
    if d.tokenizer is not None and d.source != "text":
        yield _Hit(
            f"data.tokenizer={d.tokenizer} is ignored by data.source={d.source}",
            "set data.source=text, or data.tokenizer=null",
        )


@rule(
    "MOE047",
    "data",
    "error",
    ["data.eval_fraction", "train.eval_interval", "data.eval_path"],
    "eval_fraction fits the eval settings",
)
def eval_fraction_fits(c: Context) -> Iterator[_Hit]:
    """eval_fraction is the share of the data held out for evaluation: it must be < 1 (something is left
    to train on), and > 0 when evaluation is on (eval_interval set), or there is nothing to evaluate. With
    data.eval_path set, evaluation reads that file instead and the fraction is not used."""
    f, every = c.cfg.data.eval_fraction, c.cfg.train.eval_interval
    if c.cfg.data.eval_path:
        return
    if every is not None and not 0 < f < 1:
        yield _Hit(
            f"data.eval_fraction={fmt(f)} must be in (0, 1) with train.eval_interval={every}",
            "set data.eval_fraction to e.g. 0.05, or train.eval_interval=null",
        )
    elif every is None and not 0 <= f < 1:
        yield _Hit(f"data.eval_fraction={fmt(f)} must be in [0, 1)", "set data.eval_fraction to e.g. 0.05")


@rule(
    "MOE048",
    "precision",
    "error",
    ["mixed_precision.fp8_param_gather", "mixed_precision.fp8_recipe", "optimizer.optimizer"],
    "fp8 param gather supports tensorwise, delayed, blockwise and mxfp8; param gather needs adam or muon",
)
def param_gather_recipe_supported(c: Context) -> Iterator[_Hit]:
    """Low-precision param gather builds each rank's low-precision weight from gathered data alone.
    Per-tensor FP8 (tensorwise, delayed) gathers FP8 bytes quantized with one scale per tensor that the
    ranks agree on through an amax all-reduce; blockwise likewise with one scale per 128x128 block: each
    rank takes the amax of the blocks its shard touches, one all-reduce (MAX) gives every block's amax,
    as Megatron and TE gather Float8BlockScaling params (its square tiles make the columnwise copy an exact
    transpose of the gathered bytes); mxfp8 (and nvfp4) gather bf16 and quantize locally. rowwise fits
    none: its columnwise copy is re-quantized along the other dim from the high-precision weight, which no
    rank holds. SGD runs on the one-device engine, which has no buffers, shards or gather at all, so the
    flag would be silently ignored."""
    mp = c.cfg.mixed_precision
    if mp.fp8 is not None and mp.fp8_param_gather and mp.fp8_recipe == "rowwise":
        yield _Hit(
            f"mixed_precision.fp8_param_gather=true is not supported with fp8_recipe={mp.fp8_recipe}",
            "set mixed_precision.fp8_recipe to tensorwise, delayed, blockwise or mxfp8, "
            "or mixed_precision.fp8_param_gather=false",
            keys=("mixed_precision.fp8_param_gather", "mixed_precision.fp8_recipe"),
        )
    if (mp.fp8_param_gather or mp.fp4_param_gather) and c.cfg.optimizer.optimizer == "sgd":
        which = "fp8_param_gather" if mp.fp8_param_gather else "fp4_param_gather"
        yield _Hit(
            f"mixed_precision.{which}=true needs the distributed optimizer, which optimizer.optimizer=sgd does not use",
            f"set optimizer.optimizer=adam, or mixed_precision.{which}=false",
            keys=(f"mixed_precision.{which}", "optimizer.optimizer"),
        )


@rule(
    "MOE049",
    "precision",
    "error|warning",
    ["mixed_precision.fp8_fast_accum_backward", "mixed_precision.fp8", "mixed_precision.fp8_recipe"],
    "fp8_fast_accum_backward needs an fp8 recipe with native GEMMs",
)
def fp8_fast_accum_backward_needs_native_fp8(c: Context) -> Iterator[_Hit]:
    """`fp8_fast_accum_backward` switches the native fp8 dgrad and wgrad GEMMs (`torch._scaled_mm`,
    `torch._scaled_grouped_mm`) from split accumulation (TE's choice for the backward) to the fast
    accumulator that fprop always uses (torchao's choice for fp8 MoE training): faster backward GEMMs on
    Hopper, at some backward precision. It has no meaning without fp8 (an error: the run would silently
    ignore it), and no effect under blockwise or mxfp8, whose GEMMs are emulated in fp32 on every device in
    this build (a warning)."""
    mp = c.cfg.mixed_precision
    if not mp.fp8_fast_accum_backward:
        return
    if mp.fp8 is None:
        yield _Hit(
            "mixed_precision.fp8_fast_accum_backward=true needs mixed_precision.fp8 (e4m3 or hybrid), got null",
            "set mixed_precision.fp8=e4m3, or mixed_precision.fp8_fast_accum_backward=false",
            keys=("mixed_precision.fp8_fast_accum_backward", "mixed_precision.fp8"),
            severity="error",
        )
    elif hardware.RECIPE_KIND.get(mp.fp8_recipe) not in ("tensor", "row"):
        yield _Hit(
            f"mixed_precision.fp8_fast_accum_backward=true has no effect with fp8_recipe={mp.fp8_recipe}: its "
            "GEMMs are emulated in fp32 on every device",
            "use fp8_recipe tensorwise, delayed or rowwise for native fp8 GEMMs, or drop fp8_fast_accum_backward",
            keys=("mixed_precision.fp8_fast_accum_backward", "mixed_precision.fp8_recipe"),
            severity="warning",
        )


@rule(
    "MOE051",
    "data",
    "error",
    ["data.dtype", "data.path", "data.eval_path", "data.source"],
    "data.dtype, data.path and data.eval_path only where the source reads them",
)
def data_keys_fit_the_source(c: Context) -> Iterator[_Hit]:
    """`data.dtype` is how the tokens and megatron sources read their files (megatron: a check against the
    index); corpus, synthetic and text decide their own dtype. `data.eval_path` is a second file for the
    file sources; corpus and synthetic read none. Set elsewhere, either would be silently ignored, and a run
    the user believes evaluates on val.bin would not, so the data loader refuses them and so does this rule."""
    d = c.cfg.data
    if d.dtype is not None and d.source not in ("tokens", "megatron"):
        yield _Hit(
            f"data.dtype={d.dtype} has no effect with data.source={d.source} (it decides its own dtype)",
            "remove data.dtype, or use data.source tokens or megatron",
            keys=("data.dtype", "data.source"),
        )
    for key, value in (("data.path", d.path), ("data.eval_path", d.eval_path)):
        if value and d.source not in ("tokens", "megatron", "text"):
            yield _Hit(
                f"{key}={value} is not read by data.source={d.source} (it reads no files)",
                f"remove {key}, or use a tokens, megatron or text source",
                keys=(key, "data.source"),
            )


def _same_data(a: str, b: str, megatron: bool) -> bool:
    """Whether two data paths name one file: resolved (a relative path, `./`, a symlink), and for Megatron data
    as the prefix of its .bin/.idx pair (a path may name the prefix or either file). Comparing the strings
    missed `train.bin` against `/abs/train.bin`."""

    def key(p: str) -> str:
        path = os.path.realpath(os.path.expanduser(p))
        if megatron and path.endswith((".bin", ".idx")):
            path = path[:-4]
        return path

    return key(a) == key(b)


@rule("MOE052", "data", "warning", ["data.eval_path", "data.path"], "eval_path is not the training file")
def eval_path_is_not_training_data(c: Context) -> Iterator[_Hit]:
    """With data.eval_path set, data.path trains whole: an eval_path naming the same file evaluates on
    training data, and eval loss then says nothing about generalisation."""
    d = c.cfg.data
    if d.eval_path and d.path and _same_data(d.eval_path, d.path, megatron=d.source == "megatron"):
        yield _Hit(
            f"data.eval_path={d.eval_path} is data.path: evaluation would measure the training data",
            "point data.eval_path at a held-out file (nanoGPT's val.bin), or unset it to hold out data.eval_fraction",
        )


#: the keys only Muon reads: every `optimizer.muon_*` the schema has
MUON_KEYS = tuple(f.name for f in fields(OptimizerConfig) if f.name.startswith("muon_"))


@rule(
    "MOE053",
    "optimizer",
    "warning",
    [*(f"optimizer.{k}" for k in MUON_KEYS), "optimizer.optimizer"],
    "optimizer.muon_* keys are read only by Muon",
)
def muon_keys_only_for_muon(c: Context) -> Iterator[_Hit]:
    """Only Muon reads its momentum, Newton-Schulz iteration (steps, dtype, method) and splits; AdamW and SGD
    never do, so a value chosen for them is silently ignored, which usually means the optimizer is not the one
    intended (a user trial set muon_ns_steps=0 under adam: "valid", then refused once it switched to Muon).
    Their ranges are checked where Muon reads them (MOE012, MOE041)."""
    o = c.cfg.optimizer
    if o.optimizer == "muon":
        return
    defaults = OptimizerConfig()
    for key in MUON_KEYS:
        value, default = getattr(o, key), getattr(defaults, key)
        if value != default:
            yield _Hit(f"optimizer.{key}={fmt(value)} is ignored by optimizer.optimizer={o.optimizer}",
                       f"set optimizer.optimizer=muon, or drop optimizer.{key} (default {fmt(default)})",
                       keys=(f"optimizer.{key}", "optimizer.optimizer"))


@rule(
    "MOE054",
    "hardware",
    "warning",
    ["optimizer.muon_compute_dtype", "optimizer.optimizer", "device"],
    "bf16 Newton-Schulz needs sm80+",
)
def muon_bf16_needs_sm80(c: Context) -> Iterator[_Hit]:
    """Muon's bf16 Newton-Schulz is there to run its GEMMs on bf16 tensor cores, which arrived with
    Ampere (sm80); older GPUs run bf16 GEMMs slowly or not at all (as MOE039 says for bf16 compute).
    `auto` picks fp32 there by itself; an explicit bfloat16 is taken as asked, hence the warning."""
    o, dev = c.cfg.optimizer, c.device
    if o.optimizer == "muon" and o.muon_compute_dtype == "bfloat16" and dev is not None and dev.cuda_before((8, 0)):
        yield _Hit(
            f"optimizer.muon_compute_dtype=bfloat16 on {dev.describe()}: no bf16 tensor cores before sm80",
            "set optimizer.muon_compute_dtype=auto (fp32 there), or run on sm80+",
        )


@rule("MOE069", "hardware", "error", ["train.device", "device"], "train.device=cuda needs a GPU")
def cuda_device_needs_a_gpu(c: Context) -> Iterator[_Hit]:
    """`train.device: cuda` checked against a CPU (`--device-capability cpu`) passed validation and then
    refused at start-up; the rule says so first. With no device known the rule stays silent, as hardware rules
    do on a login node."""
    dev = c.device
    if c.cfg.train.device == "cuda" and dev is not None and dev.kind == "cpu":
        yield _Hit(f"train.device=cuda but the run is checked against {dev.describe()}",
                   "set train.device=auto (or cpu), or check against the GPU (--device-capability 9.0)")  # fmt: skip


# ------------------------------------------------------------------------------------------------ compile


@rule("MOE055", "compile", "error", ["train.compile", "device"], "regional compile on the CPU needs a C++ compiler")
def cpu_compile_needs_cxx(c: Context) -> Iterator[_Hit]:
    """`train.compile=regional` compiles the norms, attention core and routers with torch.compile's inductor,
    which on the CPU generates C++ and builds it with `$CXX` (else `g++`). Without that compiler the first
    step would fail inside inductor; `auto` compiles only on CUDA (Triton, no C++), so it never needs one."""
    if c.cfg.train.compile == "regional" and c.device is not None and c.device.kind == "cpu" and not c.env.cxx:
        yield _Hit(
            f"train.compile=regional on {c.device.describe()}, and no C++ compiler ({os.environ.get('CXX') or 'g++'}) "
            "is on PATH for inductor",
            "install g++ (or set CXX), or set train.compile=auto (regional on CUDA, none on the CPU) or none",
        )


@rule(
    "MOE056",
    "hardware",
    "warning",
    ["gpu_memory", "world_size"],
    "the per-rank memory estimate fits the GPU memory given with --gpu-memory",
)
def memory_fits_gpu(c: Context) -> Iterator[_Hit]:
    """`validate-config --gpu-memory 80` (GiB, or a name such as H100) compares the per-rank estimate
    that the summary prints - weights, grads, fp32 masters and optimizer state, without activations - with
    one GPU's memory. An estimate above it cannot run at all; activations, the CUDA context and
    communication buffers come on top, so a fit with little to spare may still run out. A warning, not an
    error: the estimate leaves things out and the remedy (more ranks, expert parallelism, bf16, the
    distributed optimizer) is the user's choice. Silent without --gpu-memory."""
    if c.gpu_memory is None:
        return
    try:
        est = memory(c.cfg, c.world_size)
    except (ValueError, ZeroDivisionError):  # sizes the other rules reject
        return
    if est.total > c.gpu_memory.bytes:
        yield _Hit(
            f"the estimate is {human_bytes(est.total)} per rank before activations (weights "
            f"{human_bytes(est.weights)}, grads {human_bytes(est.grads)}, masters {human_bytes(est.masters)}, "
            f"optimizer {human_bytes(est.optimizer)}) on {c.world_size} rank(s); one GPU has "
            f"{human_bytes(c.gpu_memory.bytes)}",
            "use more ranks (the distributed optimizer shards masters and state over them), a larger "
            "parallel.expert_model_parallel_size, mixed_precision.bf16=true, or a smaller model",
        )


@rule(
    "MOE057",
    "parallel",
    "error",
    ["parallel.distributed_timeout_minutes"],
    "parallel.distributed_timeout_minutes is positive",
)
def distributed_timeout_positive(c: Context) -> Iterator[_Hit]:
    """The collective timeout is how long a rank waits for the others before the run fails naming it; a
    zero or negative one would fail the first collective at once. Fractions are allowed (0.5 = 30 s)."""
    t = c.cfg.parallel.distributed_timeout_minutes
    if not t > 0:
        yield _Hit(
            f"parallel.distributed_timeout_minutes={fmt(t)} must be > 0",
            "set it to the minutes a collective may wait (10 is the default, as in Megatron)",
        )
