"""Blockwise FP8 param gather: FP8 bytes with 128x128 block scales (fp8 `blockwise` + `fp8_param_gather`).

Megatron and Transformer Engine gather Float8BlockScaling params this way, and so does this storage. It is
`PerTensorFP8Storage` (quantized_storage.py) with a block grid where that one has a tensor:

    prepare_stage  every rank takes max |master cast to the param dtype| of each 128x128 block its shard
                   touches (0 for the others: `precision/block_shard.shard_block_amax`), all blocks of all
                   params in one flat vector per process group, and ONE all-reduce (MAX) makes it every
                   block's amax; each rank then computes the same power-of-two scales from it (TE's rule,
                   `scale_from_amax`), so the scales need no gather of their own: they are the same bytes
                   on every rank, snapshotted with the staged bytes they encode
    stage          this rank's shard of FP8 bytes, each element scaled by its own block's scale
                   (`quantize_block_shard`, bitwise what quantizing the whole weight gives)
    gather         the buffer all-gather ships the bytes (1 byte per param)
    post_gather    rowwise data = a view of the gathered bytes, decode scales = 1 / scale in the block grid
                   `[..., Mb, Kb]`; published rowwise only: the columnwise copy of square tiles is the exact
                   transpose of data and scales, built at its first backward use and cached until the next
                   gather (as for per-tensor FP8). Per-expert params of one module are published together
                   (one copy of their bytes, one of their block scales, `publish_experts`)

A block spans rows of one expert only (each expert is its own `[out, in]` matrix); a partial edge block is
quantized as if padded with zeros, as the recipe's own quantize does. So ON equals OFF bitwise: the model
holds exactly `recipe.quantize_weight(master cast to the param dtype)` either way
(tests/acceptance/test_pg_blockwise.py).
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.distributed.quantized_storage import PerTensorFP8Storage
from trainer.precision.block_shard import block_grid, quantize_block_shard, shard_block_amax


class BlockwiseFP8Storage(PerTensorFP8Storage):
    """FP8 bytes in a uint8 buffer, 128x128 block scales agreed over the ranks (see the module docstring)."""

    SCHEME_KIND = "block"

    @property
    def key(self) -> str:
        return f"fp8_blockwise:{self.recipe.name}"

    def slots(self, param: nn.Parameter) -> int:
        """Block scales of `param`: its block grid, per expert of a grouped `[E, out, in]` weight."""
        mats, Mb, Kb = block_grid(param.shape, self.scheme.block)
        return mats * Mb * Kb

    def scale_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        _, Mb, Kb = block_grid(param.shape, self.scheme.block)
        return (*param.shape[:-2], Mb, Kb)

    def piece_amax(self, param: nn.Parameter, x: torch.Tensor, first: int) -> torch.Tensor:
        return shard_block_amax(x, first, param.shape, self.scheme.block)

    def quantize_piece(self, param: nn.Parameter, x: torch.Tensor, first: int, scale: torch.Tensor) -> torch.Tensor:
        return quantize_block_shard(x, first, param.shape, scale, self.scheme)
