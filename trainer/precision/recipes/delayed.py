"""fp8 `delayed`: per-tensor scales from a window of past amaxes, TE's DelayedScaling.

Each GEMM operand of a layer (input, weight, grad) keeps an amax history of `history_len` entries
(default 16; TE defaults to 1024). A tensor is quantized with the scale computed *before* it is seen,
from the max over the history (TE's `amax_compute_algo="max"`, margin 0):

    scale = FP8_MAX / max(history)      kept unchanged while max(history) is 0 or not finite

then its own amax is pushed into the history (newest first, oldest dropped) and the scale is updated for
next time. The first use therefore has scale 1 (empty history), and values beyond the delayed range
saturate, which is the known trade of delayed scaling. TE updates scales at the end of each step rather
than after each use; with every operand quantized once per micro-batch the sequence of scales is the same.
Activation recompute would record an amax twice; do not combine the two without resetting.

Grouped layers keep one history per expert (weights) and per token group (activations, grads), so a
grouped GEMM still equals the per-expert loop. The state is per layer: `recipe.new_state(num_groups)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from trainer.kernels.fp8_scale import scale_from_amax
from ..formats import fp8_format
from ..groups import TokenGroups
from ..quantize import quantize_with_amax
from ..quantized_tensor import QuantizedTensor
from .base import Emulate
from .tensorwise import TensorwiseRecipe

DEFAULT_HISTORY = 16


@dataclass
class AmaxHistory:
    """The amax window and current encode scale of one operand role (`shape`: () or (E,))."""

    length: int
    fmax: float
    shape: tuple[int, ...] = ()
    history: Optional[torch.Tensor] = None  # [length, *shape], newest first
    scale: Optional[torch.Tensor] = None  # [*shape], the encode scale the next quantization uses

    def _materialize(self, device: torch.device) -> None:
        if self.history is None:
            self.history = torch.zeros(self.length, *self.shape, dtype=torch.float32, device=device)
            self.scale = torch.ones(self.shape, dtype=torch.float32, device=device)

    def current_scale(self, device: torch.device) -> torch.Tensor:
        """The encode scale to use now."""
        self._materialize(device)
        assert self.scale is not None
        return self.scale

    def record(self, amax: torch.Tensor) -> None:
        """Push `amax` (shape `shape`) and recompute the scale from the window's max."""
        self._materialize(amax.device)
        assert self.history is not None and self.scale is not None
        if tuple(amax.shape) != self.shape:
            raise ValueError(f"amax of shape {tuple(amax.shape)} for a history of shape {self.shape}")
        # In place: a CUDA graph replays the kernels on the addresses it captured, so a history or scale
        # rebound to a new tensor would leave every replay reading the values of the capture.
        self.history.copy_(torch.cat((amax.to(torch.float32).unsqueeze(0), self.history[:-1])))
        window = self.history.amax(dim=0)
        fresh = scale_from_amax(window, self.fmax)
        keep = (window == 0) | ~torch.isfinite(window)
        self.scale.copy_(torch.where(keep, self.scale, fresh))


@dataclass
class DelayedState:
    """The three amax histories of one (grouped) linear layer."""

    input: AmaxHistory
    weight: AmaxHistory
    grad: AmaxHistory


class DelayedRecipe(TensorwiseRecipe):
    """Per-tensor scaling with amax history (needs a `state` from `new_state`)."""

    name = "delayed"  # tensorwise's schemes and align_size; only where the scale comes from differs

    def __init__(
        self,
        fp8_format: Optional[str] = "e4m3",
        emulate: Emulate = "auto",
        history_len: int = DEFAULT_HISTORY,
        *,
        fast_accum_backward: bool = False,
    ) -> None:
        super().__init__(fp8_format, emulate, fast_accum_backward=fast_accum_backward)
        if history_len < 1:
            raise ValueError("history_len must be >= 1")
        self.history_len = history_len

    def new_state(self, num_groups: Optional[int] = None) -> DelayedState:
        """Fresh histories: scalar for a linear, one per expert for a grouped layer of `num_groups`."""
        shape = () if num_groups is None else (num_groups,)
        fwd, bwd = fp8_format("e4m3").max, fp8_format(self.grad_fmt).max
        return DelayedState(
            input=AmaxHistory(self.history_len, fwd, shape),
            weight=AmaxHistory(self.history_len, fwd, shape),
            grad=AmaxHistory(self.history_len, bwd, shape),
        )

    @staticmethod
    def _need(state: Any) -> DelayedState:
        if not isinstance(state, DelayedState):
            raise ValueError("the delayed recipe needs the layer's state: create it with recipe.new_state(...)")
        return state

    def _delayed(
        self,
        x: torch.Tensor,
        scheme: Scheme,
        hist: AmaxHistory,
        groups: Optional[TokenGroups],
        rowwise: bool,
        columnwise: bool,
    ) -> QuantizedTensor:
        # The tensor's own amax comes with the quantization (on the Triton fast path, from the same pass)
        q, amax = quantize_with_amax(
            x, scheme, rowwise=rowwise, columnwise=columnwise, groups=groups,
            encode_scale=hist.current_scale(x.device), recipe=self.name,
        )
        hist.record(amax)
        return q

    def quantize_weight(self, w, *, rowwise=True, columnwise=True, amax=None, state=None):  # type: ignore[no-untyped-def]
        """Quantize with the weight history's scale, then record the weight's amax (per expert)."""
        st = self._need(state)
        if amax is not None:
            raise ValueError("delayed scaling takes its scale from the amax history, not an explicit amax")
        return self._delayed(w, self.weight_scheme(), st.weight, None, rowwise, columnwise)

    def quantize_activation(self, x, *, offsets=None, groups=None, rowwise=True, columnwise=True, state=None):  # type: ignore[no-untyped-def]
        """Quantize with the input history's scale (per token group), then record."""
        st = self._need(state)
        if groups is None and offsets is not None:
            groups = TokenGroups.from_offsets(offsets, x.shape[0], validate=x.device.type == "cpu")
        return self._delayed(x, self.activation_scheme(), st.input, groups, rowwise, columnwise)

    def quantize_grad(self, g, *, offsets=None, groups=None, rowwise=True, columnwise=True, state=None):  # type: ignore[no-untyped-def]
        """Quantize with the grad history's scale (per token group), then record."""
        st = self._need(state)
        if groups is None and offsets is not None:
            groups = TokenGroups.from_offsets(offsets, g.shape[0], validate=g.device.type == "cpu")
        return self._delayed(g, self.grad_scheme(), st.grad, groups, rowwise, columnwise)
