"""Expert layouts of a named tensor set: detect, stack/unbind, and reorder fc1's gate/up rows.

Pure functions over `{name: Tensor}` (model weights, masters and optimizer moments alike), shared by
`moectl ckpt convert`, the HF converters and the loader (`normalize_for_model`, also the
`load_main_params_from_ckpt` path): one normalisation, so a checkpoint can never load differently
through two doors.

Expert tensor names (Megatron-Core keys, see trainer/moe/experts.py), optionally followed by an optimizer
suffix (`.main_param`, `.exp_avg`, `.exp_avg_sq`, `.momentum_buffer`):

    single-grouped   <p>.experts.linear_fc1.weight   [E, H, D]     <p>.experts.linear_fc1.bias   [E, H]
    per-expert       <p>.experts.linear_fc1.weight{e} [H, D]       <p>.experts.linear_fc1.bias{e} [H]

(fc2 likewise, `[E, D, F]` / `[D, F]`). H = 2F for gated activations, rows `[gate; up]`, or with
`glu_interleave_size = I` blocks `[g(I), u(I), g(I), ...]`: interleaved row `b*2I + h*I + o` holds contiguous
row `h*F + b*I + o` (h = 0 gate, 1 up). Weights and biases of fc1 are reordered alike.

Strict where Megatron's normalisers skip silently: an incomplete expert set, an index out of range, both
forms of one tensor, a count that does not match `num_experts`, or a name under `.experts.linear_fc` that
is none of the above is a `CheckpointError` naming the tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping, Optional

import torch

from moectl.core.errors import CheckpointArgumentError, CheckpointError

SINGLE_GROUPED = "single-grouped"
PER_EXPERT = "per-expert"
LAYOUTS = (SINGLE_GROUPED, PER_EXPERT)
OPTIMIZER_SUFFIXES = (".main_param", ".exp_avg", ".exp_avg_sq", ".momentum_buffer")

Layout = Literal["single-grouped", "per-expert"]
Kind = Literal["weight", "bias"]

_EXPERT_RE = re.compile(
    r"^(?P<prefix>.+\.experts\.linear_fc(?P<fc>[12]))\.(?P<kind>weight|bias)(?P<index>0|[1-9]\d*)?"
    r"(?P<suffix>\.main_param|\.exp_avg|\.exp_avg_sq|\.momentum_buffer)?$"
)
_EXPERT_HINT = ".experts.linear_fc"


@dataclass(frozen=True)
class ExpertKey:
    """A parsed expert tensor name: `{prefix}.{kind}{index}{suffix}`, index None for the grouped form."""

    prefix: str  # e.g. decoder.layers.0.mlp.experts.linear_fc1
    fc: int  # 1 or 2
    kind: str  # weight | bias
    index: Optional[int]
    suffix: str  # '' for the model tensor, else one of OPTIMIZER_SUFFIXES

    @property
    def grouped_name(self) -> str:
        """The single-grouped name of this tensor's group."""
        return f"{self.prefix}.{self.kind}{self.suffix}"

    def member_name(self, e: int) -> str:
        """The per-expert name of expert `e` of this tensor's group."""
        return f"{self.prefix}.{self.kind}{e}{self.suffix}"


@dataclass
class ExpertGroup:
    """One logical `[E, ...]` tensor: present either grouped (`grouped` set) or as `members` by expert index."""

    key: ExpertKey  # with index None
    grouped: Optional[str] = None
    members: dict[int, str] = field(default_factory=dict)

    @property
    def layout(self) -> Layout:
        return SINGLE_GROUPED if self.grouped is not None else PER_EXPERT

    def names(self) -> list[str]:
        """The names the group occupies, grouped name or members in expert order."""
        return [self.grouped] if self.grouped is not None else [self.members[e] for e in sorted(self.members)]


def parse_expert_key(name: str) -> Optional[ExpertKey]:
    """The parsed expert key, None for a non-expert tensor; CheckpointError for a name that only looks like one."""
    m = _EXPERT_RE.match(name)
    if m is None:
        if _EXPERT_HINT in name:
            raise CheckpointError(
                f"tensor {name!r} is under {_EXPERT_HINT} but is not weight/bias, weight{{e}}/bias{{e}} "
                f"(+ one of {', '.join(OPTIMIZER_SUFFIXES)})",
                "rename or drop it: moectl cannot tell which expert layout it belongs to",
            )
        return None
    idx = m.group("index")
    return ExpertKey(m.group("prefix"), int(m.group("fc")), m.group("kind"), int(idx) if idx is not None else None,
                     m.group("suffix") or "")  # fmt: skip


def group_expert_keys(names: Iterable[str], num_experts: int) -> dict[str, ExpertGroup]:
    """Every expert group of `names`, keyed by its grouped name, checked complete and unambiguous."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    groups: dict[str, ExpertGroup] = {}
    for name in names:
        k = parse_expert_key(name)
        if k is None:
            continue
        g = groups.setdefault(k.grouped_name, ExpertGroup(ExpertKey(k.prefix, k.fc, k.kind, None, k.suffix)))
        if k.index is None:
            g.grouped = name
        elif k.index >= num_experts:
            raise CheckpointError(
                f"tensor {name!r} is expert {k.index}, but num_experts is {num_experts}",
                "check moe.num_experts against the checkpoint (`moectl ckpt inspect`)",
            )
        else:
            g.members[k.index] = name
    for gname, g in groups.items():
        if g.grouped is not None and g.members:
            raise CheckpointError(
                f"tensor {gname!r} is present both grouped and as per-expert {g.key.member_name(min(g.members))!r}",
                "keep one form and drop the other: the checkpoint is ambiguous",
            )
        if g.members and len(g.members) != num_experts:
            missing = [g.key.member_name(e) for e in range(num_experts) if e not in g.members]
            raise CheckpointError(
                f"expert set of {gname!r} is incomplete: missing {', '.join(missing)} (num_experts={num_experts})",
                "every expert's tensor must be present to stack them; restore the missing ones",
            )
    return groups


def detect_layout(names: Iterable[str], kind: Kind = "weight") -> Optional[Layout]:
    """The layout of the expert `kind` tensors in `names` (None when there are none); mixed is an error."""
    seen: dict[str, str] = {}
    for name in names:
        k = parse_expert_key(name)
        if k is None or k.kind != kind:
            continue
        seen.setdefault(SINGLE_GROUPED if k.index is None else PER_EXPERT, name)
        if len(seen) == 2:
            raise CheckpointError(
                f"expert {kind}s mix layouts: {seen[SINGLE_GROUPED]!r} is single-grouped, "
                f"{seen[PER_EXPERT]!r} is per-expert",
                "convert the checkpoint to one layout (`moectl ckpt convert --layout ...`)",
            )
    return next(iter(seen), None)  # type: ignore[return-value]


def to_single_grouped(
    tensors: Mapping[str, torch.Tensor], num_experts: int, kinds: Iterable[str] = ("weight", "bias")
) -> dict[str, torch.Tensor]:
    """Stack every per-expert group of `kinds` (and its optimizer twins) into one `[E, ...]` tensor.

    Other tensors pass through as the same objects; output keeps input order (a stack takes expert 0's place).
    """
    kinds = tuple(kinds)
    groups = group_expert_keys(tensors, num_experts)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        k = parse_expert_key(name)
        if k is None or k.kind not in kinds:
            out[name] = t
        elif k.index is None:
            _check_grouped(name, t, num_experts)
            out[name] = t
        elif k.index == 0:
            g = groups[k.grouped_name]
            parts = [tensors[g.members[e]] for e in range(num_experts)]
            for e, p in enumerate(parts):
                if p.shape != parts[0].shape or p.dtype != parts[0].dtype:
                    raise CheckpointError(
                        f"tensor {g.members[e]!r} is {_desc(p)}, but {g.members[0]!r} is {_desc(parts[0])}",
                        "all experts of one tensor must share shape and dtype to be stacked",
                    )
            out[k.grouped_name] = torch.stack(parts)
    return out


def to_per_expert(
    tensors: Mapping[str, torch.Tensor], num_experts: int, kinds: Iterable[str] = ("weight", "bias")
) -> dict[str, torch.Tensor]:
    """Unbind every grouped `[E, ...]` tensor of `kinds` (and its optimizer twins) into `{name}{e}` tensors.

    The per-expert tensors are contiguous views of the grouped one (no copy); other tensors pass through.
    """
    kinds = tuple(kinds)
    group_expert_keys(tensors, num_experts)  # completeness and ambiguity checks
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        k = parse_expert_key(name)
        if k is None or k.kind not in kinds or k.index is not None:
            out[name] = t
            continue
        _check_grouped(name, t, num_experts)
        t = t.contiguous()
        for e in range(num_experts):
            out[k.member_name(e)] = t[e]
    return out


def _check_grouped(name: str, t: torch.Tensor, num_experts: int) -> None:
    want_ndim = 3 if parse_expert_key(name).kind == "weight" else 2  # type: ignore[union-attr]
    if t.dim() != want_ndim or t.shape[0] != num_experts:
        raise CheckpointError(
            f"tensor {name!r} is {_desc(t)}, expected {want_ndim}-D with {num_experts} experts first",
            "check moe.num_experts against the checkpoint (`moectl ckpt inspect`)",
        )


def _desc(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def fc1_row_order(from_interleave: Optional[int], to_interleave: Optional[int], ffn_size: int) -> torch.Tensor:
    """Source row of each target row of fc1 (`out = t.index_select(rows_dim, order)`), None = `[gate; up]`."""
    F = ffn_size
    for i, error in ((from_interleave, CheckpointError), (to_interleave, CheckpointArgumentError)):
        # the source's is recorded in the checkpoint (a bad one is the checkpoint's fault), the target's asked for
        if i is not None and (isinstance(i, bool) or not isinstance(i, int) or i <= 0 or F % i):
            raise error(
                f"glu_interleave_size {i!r} must be a positive int dividing the expert ffn size {F}",
                "pick an interleave that divides moe.ffn_hidden_size, or null",
            )
    j = torch.arange(2 * F)
    if to_interleave is None:  # target row j = h*F + f
        h, f = j // F, j % F
    else:  # target row j = b*2I + h*I + o, f = b*I + o
        i = to_interleave
        h, f = (j % (2 * i)) // i, (j // (2 * i)) * i + j % i
    if from_interleave is None:
        return h * F + f
    i = from_interleave
    return (f // i) * (2 * i) + h * i + f % i


def reinterleave_fc1(
    t: torch.Tensor, from_interleave: Optional[int], to_interleave: Optional[int], ffn_size: int, dim: int = 0
) -> torch.Tensor:
    """fc1 rows (weight or bias, along `dim`) reordered between interleave sizes; bit-exact (a gather).

    Returns `t` itself when the sizes are equal.
    """
    if from_interleave == to_interleave:
        return t
    if t.shape[dim] != 2 * ffn_size:
        raise CheckpointError(
            f"fc1 tensor {_desc(t)} has {t.shape[dim]} rows on dim {dim}, expected 2 * ffn size = {2 * ffn_size}",
            "only gated activations (gate and up halves) can be re-interleaved",
        )
    order = fc1_row_order(from_interleave, to_interleave, ffn_size).to(t.device)
    return t.index_select(dim, order)


def reinterleave_experts(
    tensors: Mapping[str, torch.Tensor],
    from_interleave: Optional[int],
    to_interleave: Optional[int],
    ffn_size: Optional[int] = None,
) -> dict[str, torch.Tensor]:
    """Every expert fc1 weight and bias (either layout, optimizer twins too) re-interleaved; others pass through.

    `ffn_size` (F) defaults to half of each tensor's rows; give it to have that checked too.
    """
    if from_interleave == to_interleave:
        return dict(tensors)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        k = parse_expert_key(name)
        if k is None or k.fc != 1:
            out[name] = t
            continue
        dim = 1 if k.index is None else 0
        if t.dim() <= dim:
            raise CheckpointError(f"fc1 tensor {name!r} is {_desc(t)}: it has no row dimension {dim}",
                                  "check the checkpoint's expert layout (`moectl ckpt inspect`)")  # fmt: skip
        F = ffn_size if ffn_size is not None else t.shape[dim] // 2
        try:
            out[name] = reinterleave_fc1(t, from_interleave, to_interleave, F, dim)
        except CheckpointError as e:
            raise CheckpointError(f"tensor {name!r}: {e.message}", e.fix) from None
    return out


def normalize_for_model(
    tensors: Mapping[str, torch.Tensor],
    *,
    num_experts: int,
    target_layout: Layout,
    source_interleave: Optional[int],
    target_interleave: Optional[int],
    target_bias_layout: Optional[Layout] = None,
    ffn_size: Optional[int] = None,
) -> dict[str, torch.Tensor]:
    """Bring a checkpoint's tensors to a model's expert layout and fc1 interleave (the loader's one entry).

    Re-interleaves fc1 rows from `source_interleave` (the checkpoint's `glu_interleave_size`) to
    `target_interleave`, then stacks or unbinds expert weights to `target_layout` and biases to
    `target_bias_layout` (default: the same; a model with `single_grouped_weight` but per-expert biases
    passes `per-expert`). Optimizer twins follow their parameter. Bit-exact; non-expert tensors pass through.
    """
    for what, lay in (("target_layout", target_layout), ("target_bias_layout", target_bias_layout)):
        if lay is not None and lay not in LAYOUTS:
            raise ValueError(f"{what} must be one of {LAYOUTS}, got {lay!r}")
    group_expert_keys(tensors, num_experts)
    out = reinterleave_experts(tensors, source_interleave, target_interleave, ffn_size)
    for kind, lay in (("weight", target_layout), ("bias", target_bias_layout or target_layout)):
        convert = to_single_grouped if lay == SINGLE_GROUPED else to_per_expert
        out = convert(out, num_experts, (kind,))
    return out
