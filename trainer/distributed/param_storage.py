"""How a param's values live in (or beside) the param buffer: the seam for quantized storage.

A `ParamStorage` strategy answers, for the params of one buffer:
- what the param buffer holds (`buffer_dtype`; uint8 bytes for a quantized recipe) and whether it is a
  view of the grad buffer's memory (`aliases_grad`, the MXFP8 "reuse grad buffer" staging trick);
- `bind`: how a param is tied to its buffer slice at wrap time;
- `stage`: how new values for a rank's shard are written from the fp32 masters after a step (cast; a
  per-tensor FP8 recipe would quantize with a dp-agreed amax here);
- `master_view`: whether the param buffer itself can hold a shard's fp32 masters (fp32 high-precision
  params: then the optimizer updates the params in place and never stages them);
- `post_gather`: what every rank does after the all-gather of a bucket (nothing; or quantize the
  gathered bf16 into the param and build columnwise copies, then zero the staging slice);
- `init_source` / `release_init_source`: the high-precision values the optimizer builds its masters
  from, and freeing them afterwards on every rank (never dequantize a low-precision param for masters:
  Megatron #4987 lost 0.27 nats that way; never leak the CPU copies of params a rank does not own, #5470).

High-precision strategies live here; the quantized ones (low-precision param gather) are in
`quantized_storage.py`. Two hooks exist for them: `needs_scales` + `prepare_stage` (per-tensor FP8: the
owning optimizer calls `prepare_stage` once for all its shards, a collective agreeing on every scale,
before staging any group) and `needs_initial_sync` (the live quantized weights exist only once the
optimizer has built its masters and gathered them). `digest_tensors` names what replicas must agree on
after training (the quantized bytes, not a placeholder).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from trainer.distributed.bucket import Bucket

#: One rank's shard of one bucket with its fp32 masters: (bucket, lo, hi, master[hi - lo]), bucket-local.
Shard = tuple["Bucket", int, int, torch.Tensor]


class ParamStorage(ABC):
    """Strategy for the params of one buffer. All params of a buffer share one strategy (it is part of the key)."""

    #: True when the param buffer is a view of the grad buffer's memory: staged values are wiped by
    #: zeroing grads (so they must be re-staged) and must be zeroed after post-processing.
    aliases_grad: bool = False
    #: True when `stage` needs scales agreed over the ranks first (`prepare_stage`, a collective).
    needs_scales: bool = False
    #: True when the params' live values exist only after a first stage + gather (quantized storage).
    needs_initial_sync: bool = False

    @property
    @abstractmethod
    def key(self) -> str:
        """A name that separates buffers of different strategies (part of `BufferKey`)."""

    @abstractmethod
    def buffer_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        """The element dtype of the param buffer for this param (uint8 for quantized bytes)."""

    def storage_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        """The dtype the param is stored in (the buffer key's param dtype). uint8 for quantized storage."""
        return param.dtype

    @abstractmethod
    def bind(self, param: torch.nn.Parameter, view: torch.Tensor) -> None:
        """Tie `param` to its 1-D slice `view` of the param buffer (called once, at wrap time)."""

    def stage(self, bucket: "Bucket", lo: int, hi: int, master: torch.Tensor) -> None:
        """Write new values of elements [lo, hi) of `bucket` (bucket-local) from the fp32 `master` slice."""
        bucket.param_data[lo:hi].copy_(master)

    def master_view(self, bucket: "Bucket", lo: int, hi: int) -> torch.Tensor | None:
        """Elements [lo, hi) of `bucket`'s param buffer to serve as their fp32 masters, or None.

        None (the default): the optimizer keeps a separate fp32 master and `stage` writes it into the buffer.
        """
        return None

    def publish_view(self, bucket: "Bucket", lo: int, hi: int) -> torch.Tensor | None:
        """Elements [lo, hi) of `bucket`'s param buffer, where an optimizer's update may write its new fp32
        masters cast to the buffer's dtype in place of staging them, or None.

        Only a storage whose `stage` is that cast copy and nothing else offers it; None (the default): the
        optimizer stages after its update.
        """
        return None

    def prepare_stage(self, shards: Sequence[Shard]) -> None:
        """Collective, before staging (only when `needs_scales`): agree on what `stage` needs from every rank.

        `shards` holds this rank's shard of every bucket of this storage that the caller owns.
        """

    @abstractmethod
    def post_gather(self, bucket: "Bucket") -> None:
        """Run on every rank after `bucket.param_data` holds the gathered values of the whole bucket."""

    def digest_tensors(self, param: torch.nn.Parameter) -> list[torch.Tensor]:
        """The tensors that hold `param`'s live values (replica hash checks compare these)."""
        return [param.detach()]

    def init_source(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The high-precision values masters are built from (logical shape of `param`)."""
        return param.detach()

    def replica_tensors(self, param: torch.nn.Parameter) -> list[torch.Tensor]:
        """Tensors besides the (non-aliased) param buffer that dp replicas must agree on at start.

        `DistributedModel.broadcast_params` sends them from the group's first rank: the param's own
        storage when it does not live in the buffer, and whatever `init_source` reads.
        """
        return [param.data]

    def release_init_source(self, param: torch.nn.Parameter) -> None:
        """Free whatever `init_source` kept alive; called on every rank once masters exist."""


class HighPrecisionStorage(ParamStorage):
    """The param's `.data` is a view of the param buffer (same dtype as the param).

    The gathered bucket *is* the params, so there is nothing to post-process. Binding is `param.data =
    view`: right for plain `nn.Parameter`s, including a 3-D `[E, out, in]` expert weight (tested: grads
    still reach it). Never do this to a wrapper tensor type whose `.data` setter does not remap storage
    (Megatron's grouped tensors silently stopped training that way, #6228).
    """

    @property
    def key(self) -> str:
        return "high_precision"

    def buffer_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return param.dtype

    def bind(self, param: torch.nn.Parameter, view: torch.Tensor) -> None:
        if type(param) is not torch.nn.Parameter:
            raise TypeError(
                f"HighPrecisionStorage binds plain nn.Parameter only, got {type(param).__name__}; a tensor "
                "subclass needs its own storage strategy that remaps its storage explicitly"
            )
        with torch.no_grad():
            view.copy_(param.detach().reshape(-1))
        param.data = view.view(param.shape)

    def post_gather(self, bucket: "Bucket") -> None:
        return None

    def master_view(self, bucket: "Bucket", lo: int, hi: int) -> torch.Tensor | None:
        # An fp32 param is its own fp32 master (as in Megatron's distributed optimizer): the update lands
        # in the param buffer, so there is nothing to write back. A narrower param needs a separate fp32
        # master, or updates below its resolution would be lost.
        data = bucket.param_data
        return data[lo:hi] if data.dtype == torch.float32 else None

    def publish_view(self, bucket: "Bucket", lo: int, hi: int) -> torch.Tensor | None:
        return bucket.param_data[lo:hi]  # staging here is `copy_`: the update's own cast writes the same bits

    def replica_tensors(self, param: torch.nn.Parameter) -> list[torch.Tensor]:
        return []  # the param lives in the param buffer, which is broadcast whole


class AliasedStagingStorage(ParamStorage):
    """Params keep their own storage; new values travel through a staging buffer aliased on the grad buffer.

    This is the MXFP8 "reuse grad buffer for param all-gather" flow without the quantization: the
    optimizer stages `staging_dtype(master)` into the staging buffer (which *is* grad memory), the
    all-gather ships it, and `post_gather` writes the gathered values into each param (a quantized recipe
    overrides `write_param` to quantize rowwise + columnwise instead), then zeroes only this bucket's
    staging slice so the next backward accumulates onto zeros. Because zeroing grads wipes staged values,
    `DistributedModel.zero_grad_buffer` re-stages pending groups (Megatron #4987: a deferred gather of a
    zeroed staging buffer froze the weights).
    """

    aliases_grad = True

    def __init__(self, staging_dtype: torch.dtype | None = None) -> None:
        self.staging_dtype = staging_dtype

    @property
    def key(self) -> str:
        return f"aliased_staging:{self.staging_dtype}"

    def buffer_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return self.staging_dtype or param.dtype

    def bind(self, param: torch.nn.Parameter, view: torch.Tensor) -> None:
        return None  # the param's own storage stays; `view` is grad memory, zero until staged

    def write_param(self, param: torch.nn.Parameter, gathered: torch.Tensor) -> None:
        """Turn the gathered staging values of one param (1-D) into its stored form."""
        param.detach().copy_(gathered.view(param.shape))

    def post_gather(self, bucket: "Bucket") -> None:
        with torch.no_grad():
            for param in bucket.params:
                start, end = bucket.param_ranges[param]
                self.write_param(param, bucket.param_data[start:end])
            # Only the aliased slice: the rest of the grad buffer may hold other buckets' staged values.
            bucket.param_data.zero_()
