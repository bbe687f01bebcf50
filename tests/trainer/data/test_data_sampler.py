"""The sampler: batches are a pure function of (seed, step, micro-batch, rank), so resume is exact."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from moectl.core.errors import ConfigError, DataError
from trainer.data import Sampler, TokenStream, splitmix64
from trainer.data.sampler import _GAMMA, _mix64

S = 16  # seq_length


@pytest.fixture(scope="module")
def stream() -> TokenStream:
    # Token i = i mod 251 (stored as int32), so a window's first token tells where it starts.
    return TokenStream(source="test", tokens=torch.arange(50_000, dtype=torch.int32) % 251)


def make(stream: TokenStream, **kw: int) -> Sampler:
    args = dict(seq_length=S, micro_batch_size=2, global_batch_size=8, dp_rank=0, dp_size=1, seed=7)
    args.update(kw)
    return Sampler(stream, **args)


def test_splitmix64_matches_the_reference_generator() -> None:
    # SplitMix64 from state 0: the published first two outputs (Steele et al.; also Java's SplittableRandom).
    assert _mix64(_GAMMA) == 0xE220A8397B1DCDAF
    assert _mix64((2 * _GAMMA) % 2**64) == 0x6E789E6AA1B965F4


def test_window_starts_are_pinned() -> None:
    # Pinned so that a change to the generator (which would silently break resuming old runs) fails here.
    assert [splitmix64(1234, g) % 1_000_003 for g in range(5)] == [11015, 7449, 230691, 272643, 661758]


def test_same_arguments_give_equal_batches(stream: TokenStream) -> None:
    a, b = make(stream), make(stream)
    for step, micro in [(0, 0), (3, 1), (1000, 3)]:
        xa, ya = a.micro_batch(step, micro)
        xb, yb = b.micro_batch(step, micro)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(make(stream, seed=8).micro_batch(0, 0)[0], a.micro_batch(0, 0)[0])


def test_batch_shapes_targets_and_windows(stream: TokenStream) -> None:
    s = make(stream)
    x, y = s.micro_batch(5, 2)
    assert x.shape == y.shape == (2, S) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    for row, g in zip(range(2), s.sample_ids(5, 2)):
        start = s.window_start(g)
        assert 0 <= start <= len(stream) - S - 1
        assert torch.equal(x[row], stream.tokens[start : start + S].long())
        assert int(y[row, -1]) == int(stream.tokens[start + S])


def test_window_starts_spread_over_the_stream(stream: TokenStream) -> None:
    s = make(stream)
    starts = [s.window_start(g) for g in range(4000)]
    quarters = Counter(4 * st // s.num_starts for st in starts)
    assert sorted(quarters) == [0, 1, 2, 3] and min(quarters.values()) > 800  # about 1000 each


def test_ranks_get_distinct_samples_covering_the_step(stream: TokenStream) -> None:
    ranks = [make(stream, dp_size=2, dp_rank=r) for r in range(2)]
    assert ranks[0].num_micro_batches == 2
    ids = [set(g for m in range(2) for g in r.sample_ids(3, m)) for r in ranks]
    assert not ids[0] & ids[1]
    assert ids[0] | ids[1] == set(range(3 * 8, 4 * 8))
    assert not torch.equal(ranks[0].micro_batch(3, 0)[0], ranks[1].micro_batch(3, 0)[0])


def test_resume_gives_the_batches_of_an_uninterrupted_run(stream: TokenStream) -> None:
    straight = make(stream, dp_size=2, dp_rank=1)
    seen = {step: list(straight.step_batches(step)) for step in range(13)}
    resumed = make(stream, dp_size=2, dp_rank=1)  # a fresh process, started at step 10
    for step in range(10, 13):
        for (xa, ya), (xb, yb) in zip(seen[step], resumed.step_batches(step), strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("dp,mbs", [(2, 2), (4, 1), (2, 1), (1, 4)])
def test_resharding_keeps_each_steps_samples_in_order(stream: TokenStream, dp: int, mbs: int) -> None:
    one = make(stream, dp_size=1, micro_batch_size=2)
    many = [make(stream, dp_size=dp, dp_rank=r, micro_batch_size=mbs) for r in range(dp)]
    for step in (0, 7):
        reference = torch.cat([x for x, _ in one.step_batches(step)])
        # Walking (micro, rank) in order lists the step's samples in the dp=1 order.
        rows = torch.cat([many[r].micro_batch(step, m)[0] for m in range(many[0].num_micro_batches) for r in range(dp)])
        assert torch.equal(rows, reference)


def test_eval_batches_are_fixed_and_cover_the_stream(stream: TokenStream) -> None:
    s = make(stream)
    first, again = s.eval_batches(3), s.eval_batches(3)
    assert len(first) == 3
    for (xa, ya), (xb, yb) in zip(first, again):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    starts = [st for b in s.eval_starts(3) for st in b]
    assert starts[0] == 0 and starts[-1] == s.num_starts - 1 and starts == sorted(set(starts))
    halves = [make(stream, dp_size=2, dp_rank=r, micro_batch_size=1).eval_starts(3) for r in range(2)]
    assert sorted(st for h in halves for b in h for st in b) == starts  # dp=2 evaluates the same windows


def test_eval_batches_are_read_when_asked_for_never_all_at_once(stream: TokenStream) -> None:
    """A user trial: `train.eval_iters=20000` built every eval batch at start-up (29 s, 335 MB on a tiny model);
    more would run the host out of memory. Ten million now cost nothing until read, and read the same windows."""
    s = make(stream)
    many = s.eval_batches(10_000_000)  # nothing read yet
    assert len(many) == 10_000_000
    x, y = many[-1]
    tail = stream.window(s.num_starts - 1, s.seq_length + 1)
    assert torch.equal(x[-1], tail[:-1]) and torch.equal(y[-1], tail[1:])  # the last window ends the stream
    few = s.eval_batches(3)
    eager = [s._batch(starts) for starts in s.eval_starts(3)]
    assert [tuple(map(torch.Tensor.tolist, b)) for b in few] == [tuple(map(torch.Tensor.tolist, b)) for b in eager]
    assert len(few[1:]) == 2 and torch.equal(few[1:][0][0], eager[1][0])
    with pytest.raises(IndexError):
        few[3]


def test_bad_batch_sizes_and_short_streams_are_errors(stream: TokenStream) -> None:
    with pytest.raises(ConfigError, match="multiple of"):
        make(stream, global_batch_size=6, dp_size=2, micro_batch_size=2)
    tiny = TokenStream(source="tokens", tokens=torch.zeros(S, dtype=torch.int32), path="/data/tiny.bin")
    with pytest.raises(DataError, match="/data/tiny.bin"):
        make(tiny)
    with pytest.raises(IndexError):
        make(stream).micro_batch(0, 4)


def test_a_run_that_reads_its_split_more_than_once_is_warned() -> None:
    """The sampler wraps around a small split without a word; a 129-token file trained 48 windows on its one
    window (a user trial). Reading a split at most once says nothing."""
    small = TokenStream(source="tokens", tokens=torch.arange(S + 1, dtype=torch.int32), path="x.bin", split="train")
    sampler = make(small)
    assert sampler.passes(3) == 3 * 8 * S / (S + 1)
    warning = sampler.reuse_warning(3)
    assert warning is not None and warning.startswith("warning: data: 3 steps of 8 x 16 tokens read the 17-token train")
    assert "x.bin about 23 times over (1 distinct window)" in warning and "fix: " in warning
    big = TokenStream(source="test", tokens=torch.zeros(3 * 8 * S, dtype=torch.int32))
    assert make(big).reuse_warning(3) is None and make(big).reuse_warning(4) is not None
    synthetic = TokenStream(source="synthetic", tokens=torch.arange(S + 1, dtype=torch.int32), split="train")
    assert make(synthetic).reuse_warning(3) is None  # benches' made-up tokens wrap as meant
