"""The deterministic sampler: every batch is a pure function of (seed, step, micro-batch, rank).

There is no iterator state to save or restore: resuming at step N asks for step N and gets exactly what an
uninterrupted run got (the lesson of Lightning's dropped mid-epoch fault tolerance, Lightning#18780: make
data order a pure function of seed, step and rank, never of captured RNG state).

Sample ids. With G = global_batch_size, B = micro_batch_size and dp = dp_size, the j-th row of
micro-batch m on data-parallel rank r at optimizer step s is global sample

    g = s*G + m*(B*dp) + r*B + j,        0 <= m < G/(B*dp),  0 <= j < B.

So a step consumes ids [s*G, (s+1)*G) whatever dp and B are; the ranks' rows are disjoint and together
cover the step exactly; and walking (m, r, j) in order lists the step's ids in order. Changing dp (or B)
at the same G therefore trains on the same samples in each step, which is what resharding a run needs.

Windows. Sample g reads the window of seq_length + 1 tokens starting at
`splitmix64(seed, g) mod (len(stream) - seq_length)`: inputs are its first seq_length tokens, targets the
last seq_length (inputs shifted by one). SplitMix64 (Steele, Lea & Flood 2014) is a counter-based
generator: its g-th output needs no state, and being integer arithmetic it gives the same windows on every
machine and every torch release. Windows are drawn with replacement, like nanoGPT's `get_batch`; the
modulo bias is below 2**-24 for any stream under 2**40 tokens.

Eval. `eval_batches(n)` takes windows spaced evenly over the stream (no randomness): the same batches at
every evaluation, and together the ranks cover the same windows whatever dp is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import torch

from moectl.core.errors import ConfigError, DataError

from .stream import TokenStream

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """SplitMix64's output function (a 64-bit bijection with good avalanche)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def splitmix64(seed: int, counter: int) -> int:
    """The `counter`-th 64-bit output of a SplitMix64 stream keyed by `seed` (any Python ints)."""
    key = _mix64((seed & _MASK) ^ 0x6D6F6563746C)  # keep seed 0 away from the all-zero state
    return _mix64((key + (counter + 1) * _GAMMA) & _MASK)


Batch = tuple[torch.Tensor, torch.Tensor]


class Sampler:
    """Cuts `(inputs, targets)` micro-batches out of one `TokenStream` for one data-parallel rank.

    Args:
        stream: the split to read (train for training batches, eval for `eval_batches`).
        seq_length: tokens per sequence (S).
        micro_batch_size: sequences per micro-batch on this rank (B).
        global_batch_size: sequences per optimizer step over all ranks (G); a multiple of B * dp_size.
        dp_rank: this rank's index in the data-parallel group.
        dp_size: data-parallel ranks.
        seed: `train.seed`; picks the windows.
    """

    def __init__(
        self,
        stream: TokenStream,
        *,
        seq_length: int,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
    ) -> None:
        if seq_length < 1 or micro_batch_size < 1 or dp_size < 1:
            raise ValueError("seq_length, micro_batch_size and dp_size must be positive")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        per_micro = micro_batch_size * dp_size
        if global_batch_size < per_micro or global_batch_size % per_micro:
            raise ConfigError(
                "train.global_batch_size",
                global_batch_size,
                f"must be a positive multiple of micro_batch_size * data-parallel size = "
                f"{micro_batch_size} * {dp_size} = {per_micro}",
                f"set train.global_batch_size to a multiple of {per_micro}",
            )
        if len(stream) < seq_length + 1:
            raise DataError(
                f"{stream.where}: the {stream.split} split has {len(stream):,} tokens, fewer than one sequence "
                f"of model.seq_length={seq_length} plus its target",
                "use more data or a smaller model.seq_length",
            )
        self.stream = stream
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        # Valid window starts are 0 .. len - (S+1), inclusive.
        self.num_starts = len(stream) - seq_length

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches each rank runs per optimizer step: G / (B * dp)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def passes(self, steps: int) -> float:
        """How many times `steps` optimizer steps read this split over, in tokens (windows are drawn with
        replacement, so this is the average number of times each token is seen)."""
        return steps * self.global_batch_size * self.seq_length / len(self.stream)

    def reuse_warning(self, steps: int) -> str | None:
        """A start-up warning when `steps` steps read this split more than once: the sampler wraps around a
        small split without a word (a 129-token file trained 3 steps of 16 windows on its one window, 48 times,
        in a user trial), which is rarely what a user pointing at a file meant. None when it is read at most once, and
        for synthetic data (a long bench or smoke run on its 1M made-up tokens wraps as meant)."""
        times = self.passes(steps)
        if times <= 1 or self.stream.source == "synthetic":  # made-up tokens, for benches: nothing to overfit on
            return None
        windows = self.num_starts
        return (
            f"warning: data: {steps:,} steps of {self.global_batch_size} x {self.seq_length} tokens read the "
            f"{len(self.stream):,}-token {self.stream.split} split of {self.stream.where} about {times:,.0f} times "
            f"over ({windows:,} distinct window{'s' if windows != 1 else ''}): the model sees the same data again "
            "and again. fix: use more data, or fewer train.train_iters if that is not meant"
        )

    def sample_ids(self, step: int, micro_index: int) -> range:
        """The global sample ids of this rank's micro-batch `micro_index` at `step` (see module docstring)."""
        if step < 0:
            raise ValueError(f"step {step} < 0")
        if not 0 <= micro_index < self.num_micro_batches:
            raise IndexError(f"micro_index {micro_index} is not in [0, {self.num_micro_batches})")
        first = (
            step * self.global_batch_size
            + micro_index * self.micro_batch_size * self.dp_size
            + self.dp_rank * self.micro_batch_size
        )
        return range(first, first + self.micro_batch_size)

    def window_start(self, sample_id: int) -> int:
        """Where sample `sample_id`'s window of seq_length + 1 tokens starts in the stream."""
        return splitmix64(self.seed, sample_id) % self.num_starts

    def _batch(self, starts: list[int]) -> Batch:
        rows = torch.stack([self.stream.window(s, self.seq_length + 1) for s in starts])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def micro_batch(self, step: int, micro_index: int) -> Batch:
        """`(inputs [B, S], targets [B, S])`, int64 on the CPU; targets are inputs shifted by one token."""
        return self._batch([self.window_start(g) for g in self.sample_ids(step, micro_index)])

    def step_batches(self, step: int) -> Iterator[Batch]:
        """This rank's micro-batches of optimizer step `step`, in order."""
        for m in range(self.num_micro_batches):
            yield self.micro_batch(step, m)

    def eval_starts(self, n: int) -> list[list[int]]:
        """Window starts of `eval_batches(n)`, one list of B per micro-batch."""
        return [self._eval_window_starts(m, n) for m in range(n)]

    def _eval_window_starts(self, m: int, n: int) -> list[int]:
        """This rank's B window starts of eval micro-batch `m` of `n`."""
        total = n * self.micro_batch_size * self.dp_size
        first = m * self.micro_batch_size * self.dp_size + self.dp_rank * self.micro_batch_size
        return [e * (self.num_starts - 1) // max(total - 1, 1) for e in range(first, first + self.micro_batch_size)]

    def eval_batches(self, n: int) -> "EvalBatches":
        """`n` fixed micro-batches for evaluation: windows evenly spaced over the stream, the same every call,
        each read when asked for (`EvalBatches`)."""
        return EvalBatches(self, n)


class EvalBatches(Sequence[Batch]):
    """A sampler's `n` eval micro-batches, each read from the stream when asked for (index or iteration), never
    all held at once: built up front, `train.eval_iters=20000` took 29 s and 335 MB at start-up on a tiny model
    (a user trial), and a larger count would run the host out of memory. A window read is a slice of the
    stream (a memory map for files), far cheaper than the forward that evaluates it."""

    def __init__(self, sampler: Sampler, n: int) -> None:
        self.sampler, self.n = sampler, n

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> Batch: ...

    @overload
    def __getitem__(self, i: slice) -> list[Batch]: ...

    def __getitem__(self, i: int | slice) -> Batch | list[Batch]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(f"eval micro-batch {i} of {self.n}")
        return self.sampler._batch(self.sampler._eval_window_starts(i, self.n))
