"""Is a token file being read in the dtype it was written in? Plausibility checks on the raw bytes.

A flat token file carries no dtype: nanoGPT writes uint16, llm.c's v7 and many converters uint32, byte
corpora uint8. Read in the wrong dtype, a file of ids still looks like numbers, and training runs on garbage
(a uint32 file read as uint16 is the real ids with a 0 after each). Two cheap signals catch it:

- **Read too narrow** (`too_narrow`): little-endian ids of a wider dtype put their high bytes at fixed
  positions, and for any real vocabulary (< 2**20 ids) those bytes are near zero. So when the unit in the
  high position of every w-byte group is small (< 16) almost always (>= 99%) while the low unit mostly is not
  (<= 50% small), the file holds w-byte tokens. In genuine data every position has the same distribution
  (tokens do not know their parity), so the two fractions agree, and the check stays silent.
- **Read too wide** (`narrower_fits`, used only to word an out-of-vocab error): the bytes read as a narrower
  dtype fit the vocabulary and show no such positional pattern, so they may be narrower tokens.

Both look at the first `SAMPLE_UNITS` values only (a start-up must not scan a 50 GB file twice) and need at
least `MIN_UNITS` of them (64: 32 pairs; a file shorter than that is no evidence either way, and too short
to train on). For real text about 1 token in 10 is below 16 (GPT-2's punctuation ids), so genuine data
passing for a wider dtype at 32 pairs has odds near 1e-30.
"""

from __future__ import annotations

import torch

from moectl.core.errors import DataError

from .storage import dtype_name, itemsize

#: The dtypes `data.dtype` accepts: what tokenizer pipelines actually write.
DATA_DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "uint16": torch.uint16,
    "int32": torch.int32,
    "uint32": torch.uint32,
}
SAMPLE_UNITS = 1 << 20
MIN_UNITS = 64
SMALL = 16  # a "small" unit: what the high part of a real token id almost always is
HIGH_SMALL_FRACTION = 0.99
LOW_SMALL_FRACTION = 0.5

# For each storage width, the wider dtypes to test, widest first, with the unit positions inside one group
# that hold only high bits for every id < 2**20 (uint32 read as bytes: bytes 2 and 3; as halves: half 1).
_WIDER: dict[int, list[tuple[str, int, tuple[int, ...]]]] = {
    1: [("uint32", 4, (2, 3)), ("uint16", 2, (1,))],
    2: [("uint32", 2, (1,))],
}


def data_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `data.dtype` value; `DataError` for anything else."""
    if name not in DATA_DTYPES:
        raise DataError(f"data.dtype={name!r} is not a token dtype", f"use one of {', '.join(DATA_DTYPES)}")
    return DATA_DTYPES[name]


def _unsigned_units(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """The first SAMPLE_UNITS raw values of `tokens`, reinterpreted as unsigned `width`-byte ints (int64)."""
    raw = tokens[: max(SAMPLE_UNITS * width // itemsize(tokens.dtype), 1)].view(torch.uint8)
    raw = raw[: raw.numel() // width * width]
    unsigned = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[width]
    return raw.view(unsigned).to(torch.int64)


def _small_fraction(units: torch.Tensor) -> float:
    return float((units < SMALL).float().mean()) if units.numel() else 0.0


def too_narrow(tokens: torch.Tensor) -> tuple[str, float] | None:
    """`(wider dtype, high-position small fraction)` if `tokens` look like a wider dtype read too narrow."""
    width = itemsize(tokens.dtype)
    for name, group, highs in _WIDER.get(width, []):
        units = _unsigned_units(tokens, width)
        units = units[: units.numel() // group * group].view(-1, group)
        if units.shape[0] * group < MIN_UNITS:
            return None
        high = min(_small_fraction(units[:, h]) for h in highs)
        if high >= HIGH_SMALL_FRACTION and _small_fraction(units[:, 0]) <= LOW_SMALL_FRACTION:
            return name, high
    return None


def check_plausible(tokens: torch.Tensor, *, where: str, dtype_from: str, fix: str) -> None:
    """Raise `DataError` when `tokens` (read as `dtype_from` decided) look like a wider dtype's bytes.

    Args:
        tokens: the stream in its storage dtype.
        where: the file to name.
        dtype_from: how the dtype was decided, for the message ("the default", "data.dtype", "the index" ...).
        fix: what to do about it, given where the dtype came from.
    """
    found = too_narrow(tokens)
    if found is None:
        return
    wider, fraction = found
    read, width, wide = dtype_name(tokens.dtype), itemsize(tokens.dtype), itemsize(DATA_DTYPES[wider])
    raise DataError(
        f"{where}: read as {read} ({dtype_from}), but the high part of every {wide}-byte group is near zero "
        f"({fraction:.1%} of them below {SMALL}), as when {wider} tokens are read {width} byte"
        f"{'s' if width > 1 else ''} at a time: the file holds {wider} tokens",
        fix.format(wider=wider),
    )


def narrower_fits(tokens: torch.Tensor, vocab_size: int) -> str | None:
    """A narrower dtype whose reading of the same bytes fits `vocab_size` and shows no positional pattern."""
    width = itemsize(tokens.dtype)
    for name, narrow in (("uint8", 1), ("uint16", 2)):
        if narrow >= width:
            continue
        units = _unsigned_units(tokens, narrow)
        if units.numel() < MIN_UNITS or int(units.max()) >= vocab_size:
            continue
        group = units[: units.numel() // (width // narrow) * (width // narrow)].view(-1, width // narrow)
        spread = max(abs(_small_fraction(group[:, j]) - _small_fraction(group[:, 0])) for j in range(group.shape[1]))
        if spread < 0.1:  # every position alike: nothing says these bytes pair up into wider ids
            return name
    return None
