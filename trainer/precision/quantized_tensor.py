"""The quantized storage type: what a quantized weight, activation or grad is, and how it lives in bytes.

A `QuantizedTensor` has a logical (high-precision) shape `[..., M, K]` and up to two copies:
- `rowwise`: quantized along K (the last dim), used where the GEMM contracts over K (forward);
- `columnwise`: the transpose `[..., K, M]` quantized along M, used where the GEMM contracts over M (for
  a weight: the data grad; for an activation or grad: the weight grad). TE calls these "rowwise and
  columnwise usages". Per-tensor and square-tile schemes can build it from the rowwise copy
  (`with_columnwise`), others need the high-precision source.

A grouped `[E, out, in]` weight is one tensor with a leading expert dim; every scale is per expert (or
per tile inside one expert), so `expert(e)` equals quantizing expert e alone, bitwise, and `stack` turns
per-expert tensors into the grouped one.

Bytes: `to_bytes()` lays every present tensor (rowwise data, scales, ..., then columnwise) into one flat
uint8 buffer at 16-byte-aligned offsets described by `byte_layout()`; `from_bytes(buf, layout)` rebuilds a
QuantizedTensor whose tensors are views into `buf` (no copy), so a distributed buffer can hold a param's
bytes, all-gather them, and use the result in place. A caller that gathers only some of the bytes (e.g.
per-tensor FP8: only `rowwise.data`, the scale from an all-reduced amax, the columnwise copy rebuilt
after the gather) finds each piece's offset in `ByteLayout.segments`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from moectl.core.arith import round_up

from .groups import Jagged, TokenGroups
from .kinds import KIND_MODULES
from .qdata import QuantizedData
from .scheme import Scheme

ALIGN = 16  # bytes: every segment starts here, so fp32 scales can be viewed in place and loads vectorise
COPIES = ("rowwise", "columnwise")


@dataclass(frozen=True)
class Segment:
    """One tensor inside a byte buffer."""

    name: str  # "<copy>.<field>", e.g. "rowwise.data", "columnwise.scale", "rowwise.global_scale"
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the buffer; a multiple of ALIGN
    nbytes: int


@dataclass(frozen=True)
class ByteLayout:
    """Everything needed to rebuild a QuantizedTensor from its bytes."""

    scheme: Scheme
    shape: tuple[int, ...]
    dtype: torch.dtype
    recipe: str
    segments: tuple[Segment, ...]
    nbytes: int  # total, alignment padding included

    def segment(self, name: str) -> Segment:
        """The segment called `name`."""
        for seg in self.segments:
            if seg.name == name:
                return seg
        raise KeyError(f"no segment {name!r} in this layout; have {[s.name for s in self.segments]}")


def _align(n: int) -> int:
    return round_up(n, ALIGN)


@dataclass
class QuantizedTensor:
    """A tensor in a low-precision recipe (see the module docstring)."""

    scheme: Scheme
    shape: torch.Size  # logical high-precision shape [..., M, K]
    dtype: torch.dtype  # the high-precision dtype it was quantized from (dequantize's default)
    rowwise: Optional[QuantizedData] = None
    columnwise: Optional[QuantizedData] = None
    groups: Optional[TokenGroups] = None  # token groups along dim 0 (grouped activations and grads)
    recipe: str = ""

    def __post_init__(self) -> None:
        self.shape = torch.Size(self.shape)
        if self.rowwise is None and self.columnwise is None:
            raise ValueError("a QuantizedTensor needs a rowwise or a columnwise copy")
        if len(self.shape) < 2:
            raise ValueError(f"quantized tensors are at least 2-D, got shape {tuple(self.shape)}")
        if self.groups is not None and len(self.shape) != 2:
            raise ValueError("token groups apply to 2-D [T, K] tensors only")

    # ---- basic properties -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the data lives."""
        q = self.rowwise if self.rowwise is not None else self.columnwise
        assert q is not None
        return q.data.device

    @property
    def nbytes(self) -> int:
        """Bytes of data and scales over both copies (without alignment padding)."""
        return sum(q.nbytes for q in (self.rowwise, self.columnwise) if q is not None)

    def copy(self, which: str) -> QuantizedData:
        """The `rowwise` or `columnwise` copy; a clear error if it was not made."""
        if which not in COPIES:
            raise ValueError(f"copy must be one of {COPIES}, got {which!r}")
        q = getattr(self, which)
        if q is None:
            raise ValueError(
                f"this {self.recipe or self.scheme.kind} tensor has no {which} copy; quantize it with "
                f"{which}=True" + (" or call with_columnwise()" if self.scheme.transposable else "")
            )
        return q

    def jagged(self, which: str) -> Optional[Jagged]:
        """The token groups as seen by copy `which` (rows of the rowwise copy, columns of the columnwise)."""
        if self.groups is None:
            return None
        return Jagged(self.groups, -2 if which == "rowwise" else -1)

    def copy_shape(self, which: str) -> torch.Size:
        """Logical shape of copy `which`: `[..., M, K]` or `[..., K, M]`."""
        if which == "rowwise":
            return self.shape
        return torch.Size((*self.shape[:-2], self.shape[-1], self.shape[-2]))

    # ---- values ---------------------------------------------------------------------------------
    def dequantize_copy(self, which: str = "rowwise") -> torch.Tensor:
        """fp32 values of one copy in its stored orientation (`copy_shape(which)`)."""
        return KIND_MODULES[self.scheme.kind].dequantize(
            self.copy(which), self.scheme, self.jagged(which), self.copy_shape(which)
        )

    def dequantize(self, dtype: Optional[torch.dtype] = None, *, copy: Optional[str] = None) -> torch.Tensor:
        """High-precision values in the logical orientation, from the rowwise copy (or `copy`)."""
        which = copy or ("rowwise" if self.rowwise is not None else "columnwise")
        values = self.dequantize_copy(which)
        if which == "columnwise":
            values = values.transpose(-2, -1)
        return values.to(dtype or self.dtype)

    def with_columnwise(self) -> "QuantizedTensor":
        """Build the columnwise copy from the rowwise one (per-tensor and square-tile schemes; exact).

        This is the post-all-gather step for per-tensor FP8 params: gather rowwise bytes, then transpose.
        """
        if self.columnwise is not None:
            return self
        if not self.scheme.transposable:
            raise ValueError(
                f"{self.scheme.describe()}: the columnwise copy cannot be built from the rowwise one; "
                "re-quantize from the high-precision values with columnwise=True"
            )
        self.columnwise = KIND_MODULES[self.scheme.kind].transpose(self.copy("rowwise"), self.scheme)
        return self

    # ---- bytes ----------------------------------------------------------------------------------
    def _named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for which in COPIES:
            q = getattr(self, which)
            if q is not None:
                out.extend((f"{which}.{name}", t) for name, t in q.tensors().items())
        return out

    def byte_layout(self) -> ByteLayout:
        """Where each tensor sits in the flat byte buffer of `to_bytes`."""
        if self.groups is not None:
            raise ValueError("grouped activations are not stored in byte buffers")
        segments, offset = [], 0
        for name, t in self._named_tensors():
            n = t.numel() * t.element_size()
            segments.append(Segment(name, t.dtype, tuple(t.shape), offset, n))
            offset = _align(offset + n)
        return ByteLayout(self.scheme, tuple(self.shape), self.dtype, self.recipe, tuple(segments), offset)

    def to_bytes(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """All tensors as one flat uint8 tensor (`byte_layout().nbytes` long), written into `out` if given.

        Padding bytes are zero, so equal tensors give equal buffers.
        """
        layout = self.byte_layout()
        if out is None:
            out = torch.zeros(layout.nbytes, dtype=torch.uint8, device=self.device)
        elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < layout.nbytes:
            raise ValueError(f"out must be a 1-D uint8 tensor of at least {layout.nbytes} bytes")
        for seg, (_, t) in zip(layout.segments, self._named_tensors()):
            out[seg.offset : seg.offset + seg.nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        return out

    @classmethod
    def from_bytes(cls, buf: torch.Tensor, layout: ByteLayout) -> "QuantizedTensor":
        """A QuantizedTensor whose tensors are views into `buf` (1-D uint8, at least `layout.nbytes`)."""
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"buf must be a 1-D uint8 tensor, got {buf.dtype} with shape {tuple(buf.shape)}")
        if buf.numel() < layout.nbytes:
            raise ValueError(f"buf holds {buf.numel()} bytes, the layout needs {layout.nbytes}")
        copies: dict[str, dict[str, torch.Tensor]] = {}
        for seg in layout.segments:
            which, name = seg.name.split(".", 1)
            size = torch.empty((), dtype=seg.dtype).element_size()
            if (buf.storage_offset() + seg.offset) % size:
                raise ValueError(
                    f"segment {seg.name} ({seg.dtype}) would start at byte {buf.storage_offset() + seg.offset} "
                    f"of its storage, not a multiple of {size}; give the buffer slice a {ALIGN}-byte aligned start"
                )
            view = buf[seg.offset : seg.offset + seg.nbytes].view(seg.dtype).view(seg.shape)
            copies.setdefault(which, {})[name] = view
        return cls(
            scheme=layout.scheme,
            shape=torch.Size(layout.shape),
            dtype=layout.dtype,
            rowwise=QuantizedData(**copies["rowwise"]) if "rowwise" in copies else None,
            columnwise=QuantizedData(**copies["columnwise"]) if "columnwise" in copies else None,
            recipe=layout.recipe,
        )

    def copy_(self, src: "QuantizedTensor") -> "QuantizedTensor":
        """Overwrite this tensor's storage with `src`'s values (same layout), e.g. re-quantized params
        written into views of a param buffer."""
        mine, theirs = self._named_tensors(), src._named_tensors()
        if (
            src.scheme != self.scheme
            or src.shape != self.shape
            or [(n, t.shape, t.dtype) for n, t in mine] != [(n, t.shape, t.dtype) for n, t in theirs]
        ):
            raise ValueError("copy_ needs the same scheme, shape and copies")
        for (_, dst), (_, s) in zip(mine, theirs):
            dst.copy_(s)
        return self

    def clone(self) -> "QuantizedTensor":
        """A deep copy."""
        return replace(
            self,
            rowwise=self.rowwise.map(torch.clone) if self.rowwise is not None else None,
            columnwise=self.columnwise.map(torch.clone) if self.columnwise is not None else None,
        )

    # ---- experts --------------------------------------------------------------------------------
    def expert(self, index: int) -> "QuantizedTensor":
        """Expert `index` of a grouped `[E, out, in]` tensor, as views (bitwise equal to quantizing it alone)."""
        if len(self.shape) != 3:
            raise ValueError(f"expert() needs a grouped [E, out, in] tensor, got shape {tuple(self.shape)}")
        return replace(
            self,
            shape=self.shape[1:],
            rowwise=self.rowwise.map(lambda t: t[index]) if self.rowwise is not None else None,
            columnwise=self.columnwise.map(lambda t: t[index]) if self.columnwise is not None else None,
        )

    def unbind(self) -> list["QuantizedTensor"]:
        """All experts of a grouped tensor."""
        return [self.expert(e) for e in range(self.shape[0])]

    @classmethod
    def stack(cls, experts: Sequence["QuantizedTensor"]) -> "QuantizedTensor":
        """One grouped `[E, out, in]` tensor from E per-expert `[out, in]` tensors of one scheme."""
        first = experts[0]
        for q in experts[1:]:
            if (q.scheme, q.shape, q.dtype, q.recipe) != (first.scheme, first.shape, first.dtype, first.recipe):
                raise ValueError("stack needs experts of one scheme, shape and dtype")
            if (q.rowwise is None) != (first.rowwise is None) or (q.columnwise is None) != (first.columnwise is None):
                raise ValueError("stack needs every expert to have the same copies")

        def stacked(which: str) -> Optional[QuantizedData]:
            if getattr(first, which) is None:
                return None
            names = getattr(first, which).tensors().keys()
            return QuantizedData(**{n: torch.stack([getattr(q, which).tensors()[n] for q in experts]) for n in names})

        return cls(
            scheme=first.scheme,
            shape=torch.Size((len(experts), *first.shape)),
            dtype=first.dtype,
            rowwise=stacked("rowwise"),
            columnwise=stacked("columnwise"),
            recipe=first.recipe,
        )

    def __repr__(self) -> str:
        copies = [c for c in COPIES if getattr(self, c) is not None]
        return (
            f"QuantizedTensor({self.recipe or self.scheme.kind}: {self.scheme.describe()}, "
            f"shape={tuple(self.shape)}, copies={copies}, nbytes={self.nbytes})"
        )
