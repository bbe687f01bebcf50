"""Token groups of a grouped GEMM: which rows of `x_TD` belong to which expert.

The grouped activation `x_TD` holds the rows of E experts back to back (`offs_E[e]` is the end row of
expert e, the `offs` convention of `torch._grouped_mm`). Quantizing it must give exactly what quantizing
each expert's rows on its own would give, so that a grouped GEMM equals the per-expert loop:
- per-tensor scales (tensorwise, delayed, NVFP4's fp32 global scale) are one scale per group;
- the columnwise copy (x^T, contracting over tokens for the weight grad) must not let a block or a row
  scale span two experts: row scales become one per (feature, group), and fixed-size blocks along the
  token dim need every group to start on a block boundary, which the dispatcher's per-expert padding
  to `recipe.align_size` guarantees (Megatron's `get_align_size_for_quantization`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenGroups:
    """Consecutive row groups of a 2-D `[T, K]` tensor."""

    offsets: torch.Tensor  # int64 [G]: end row of each group; offsets[-1] == T
    ids: torch.Tensor  # int64 [T]: group of each row
    # rows of every group when the caller knows them on the host to be equal (drop-and-pad experts): then
    # nothing about the groups needs a device-to-host read, which a CUDA graph capture forbids
    uniform: int | None = None

    @functools.cached_property
    def offsets_i32(self) -> torch.Tensor:
        """The offsets as int32, what `torch._grouped_mm` takes (made once per groups object, not per GEMM)."""
        return self.offsets.to(torch.int32)

    @property
    def count(self) -> int:
        """G, the number of groups."""
        return int(self.offsets.numel())

    @property
    def total(self) -> int:
        """T, the number of rows."""
        return int(self.ids.numel())

    @classmethod
    def from_offsets(
        cls, offsets: torch.Tensor, total: int, *, validate: bool = True, uniform: int | None = None
    ) -> "TokenGroups":
        """Groups from cumulative end offsets (any integer dtype). `validate` reads the offsets (a host
        sync on CUDA): 1-D, non-decreasing, non-negative, last one == `total`. `uniform`: the rows of every
        group, when the caller knows them to be equal (checked against `total` here, and against the
        offsets where `validate` reads them)."""
        offs = offsets.to(torch.int64).reshape(-1)
        if offs.numel() == 0:
            raise ValueError("grouped GEMM needs at least one group (offs is empty)")
        if uniform is not None and uniform * offs.numel() != total:
            raise ValueError(f"{offs.numel()} groups of {uniform} rows do not make {total} rows")
        if validate:
            counts = torch.diff(offs, prepend=offs.new_zeros(1))
            if bool((counts < 0).any()) or int(offs[-1]) != total:
                raise ValueError(
                    f"offs must be non-decreasing end offsets with offs[-1] == rows ({total}); got {offs.tolist()}"
                )
            if uniform is not None and bool((counts != uniform).any()):
                raise ValueError(f"groups said to hold {uniform} rows each; got group ends {offs.tolist()}")
        # row t is in the group g with offs[g-1] <= t < offs[g], i.e. g = #{offsets <= t}: two launches
        # (arange, searchsorted) where diff + repeat_interleave took six, on the fp8 expert MLP's host path
        ids = torch.searchsorted(offs, torch.arange(total, device=offs.device), right=True)
        groups = cls(offs, ids, uniform)
        if offsets.dtype == torch.int32 and offsets.dim() == 1:
            groups.__dict__["offsets_i32"] = offsets  # already what grouped_mm takes: no second cast
        return groups

    def check_aligned(self, multiple: int, what: str) -> None:
        """Raise unless every group starts on a multiple of `multiple` (host sync on CUDA)."""
        if multiple <= 1 or self.count <= 1:
            return
        if self.uniform is not None:  # known on the host: no device read
            misaligned, got = self.uniform % multiple != 0, f"{self.uniform} rows per group"
        else:
            misaligned = bool((self.offsets[:-1] % multiple != 0).any())
            got = f"group ends {self.offsets.tolist()}" if misaligned else ""
        if misaligned:
            raise ValueError(
                f"{what}: every expert's token group must start on a multiple of {multiple} so that no "
                f"quantization block spans two experts; got {got}. Pad each "
                f"expert's rows to the recipe's align_size (the dispatcher's align option)"
            )

    def sizes(self) -> list[int]:
        """Rows per group, on the host."""
        if self.uniform is not None:
            return [self.uniform] * self.count
        return torch.diff(self.offsets, prepend=self.offsets.new_zeros(1)).tolist()

    def amax(self, values: torch.Tensor, dim: int) -> torch.Tensor:
        """Per-group max of `values` (already non-negative) over the token axis `dim` of a 2-D tensor.

        Returns shape [G] when `values` is 1-D, else the other axis first: [other, G]. Empty groups give 0;
        NaN propagates (scatter_reduce 'amax' does).
        """
        if values.dim() == 1:
            out = values.new_zeros(self.count)
            return out.scatter_reduce(0, self.ids, values, "amax", include_self=True)
        if dim in (0, -2):
            values = values.t()
        # values: [other, T] -> [other, G]
        out = values.new_zeros(values.shape[0], self.count)
        index = self.ids.unsqueeze(0).expand(values.shape[0], -1)
        return out.scatter_reduce(1, index, values, "amax", include_self=True)


@dataclass(frozen=True)
class Jagged:
    """Token groups along one axis of the 2-D copy being quantized: -2 (rowwise copy of x_TD: tokens are
    rows) or -1 (columnwise copy x^T: tokens are columns)."""

    groups: TokenGroups
    axis: int

    def per_token(self, per_group: torch.Tensor) -> torch.Tensor:
        """Broadcast a per-group tensor [G] over the copy's 2-D grid: [T, 1] or [1, T]."""
        expanded = per_group[self.groups.ids]
        return expanded.unsqueeze(-1) if self.axis == -2 else expanded.unsqueeze(0)
