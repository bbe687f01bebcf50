"""Element and scale formats against hand-computed vectors: FP8 E4M3/E5M2, E8M0, FP4 E2M1 and packing.

Expected values are worked out from the format definitions (OFP8 rev 1.0; OCP MX v1.0 sections 5.3-5.4):
E4M3 has 3 mantissa bits (in [16, 32) the step is 2, in [256, 448] it is 32), subnormal step 2^-9, max
448; E5M2 has 2 mantissa bits, subnormal step 2^-16, max 57344.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from trainer.precision.formats import E4M3, E5M2, cast_to_fp8, e8m0_from_exponent, e8m0_to_float
from trainer.precision.fp4 import decode_e2m1, encode_e2m1, pack_e2m1, unpack_e2m1

INF, NAN = math.inf, math.nan


def _fp8(values: list[float], fmt) -> list[float]:
    return cast_to_fp8(torch.tensor(values, dtype=torch.float32), fmt).float().tolist()


def test_e4m3_round_to_nearest_even() -> None:
    # 17 is halfway between 16 (mantissa 000) and 18 (001): even -> 16; 19 between 18 and 20 (010) -> 20.
    # 3 * 2^-10 is halfway between the subnormals 2^-9 (m=001) and 2^-8 (m=010) -> 2^-8.
    # 2^-10 is halfway between 0 and the smallest subnormal 2^-9 -> 0 (even).
    got = _fp8([17.0, 19.0, 3 * 2**-10, 2**-10, 260.0, 272.0, 304.0, -38.4], E4M3)
    assert got == [16.0, 20.0, 2**-8, 0.0, 256.0, 256.0, 320.0, -40.0]


def test_e4m3_saturates_and_keeps_nan() -> None:
    # Above 448 (even 464, which a non-saturating cast would round to 448 or NaN) clamps to +-448; inf too.
    got = _fp8([448.0, 449.0, 464.0, 500.0, -1000.0, INF, -INF], E4M3)
    assert got == [448.0, 448.0, 448.0, 448.0, -448.0, 448.0, -448.0]
    assert math.isnan(_fp8([NAN], E4M3)[0])


def test_e5m2_round_and_saturate() -> None:
    # In [1, 2) the step is 0.25: 1.125 ties to 1.0 (m=00), 1.375 ties to 1.5 (m=10).
    # 61440 is halfway to the next binade: a plain cast gives inf; saturating gives 57344.
    got = _fp8([1.125, 1.375, 2**-17, 1.25 * 2**-16, 60000.0, 61440.0, INF, -INF], E5M2)
    assert got == [1.0, 1.5, 0.0, 2**-16, 57344.0, 57344.0, 57344.0, -57344.0]
    assert math.isnan(_fp8([NAN], E5M2)[0])


def test_e8m0_encode_decode() -> None:
    exps = torch.tensor([0, 1, -1, -127, 127, -130, 130])
    s = e8m0_from_exponent(exps, nan=torch.tensor([False] * 6 + [False]))
    assert s.dtype == torch.float8_e8m0fnu
    # biased bytes: 127, 128, 126, 0, 254; out-of-range exponents clamp to the ends
    assert s.view(torch.uint8).tolist() == [127, 128, 126, 0, 254, 0, 254]
    assert e8m0_to_float(s).tolist() == [1.0, 2.0, 0.5, 2.0**-127, 2.0**127, 2.0**-127, 2.0**127]
    nan = e8m0_from_exponent(torch.tensor([3]), nan=torch.tensor([True]))
    assert nan.view(torch.uint8).item() == 255 and math.isnan(e8m0_to_float(nan).item())


# (input, expected E2M1 value, expected code): RNE on {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code.
E2M1_TABLE = [
    (0.0, 0.0, 0),
    (0.25, 0.0, 0),  # tie 0 (code 0) / 0.5 (code 1) -> 0
    (0.26, 0.5, 1),
    (0.5, 0.5, 1),
    (0.75, 1.0, 2),  # tie 0.5 (code 1) / 1.0 (code 2) -> 1.0
    (1.25, 1.0, 2),  # tie 1.0 (code 2) / 1.5 (code 3) -> 1.0
    (1.5, 1.5, 3),
    (1.75, 2.0, 4),  # tie 1.5 (3) / 2.0 (4) -> 2.0
    (2.5, 2.0, 4),  # tie 2 (4) / 3 (5) -> 2
    (2.6, 3.0, 5),
    (3.5, 4.0, 6),  # tie 3 (5) / 4 (6) -> 4
    (5.0, 4.0, 6),  # tie 4 (6) / 6 (7) -> 4
    (5.1, 6.0, 7),
    (6.0, 6.0, 7),
    (7.0, 6.0, 7),  # saturates
    (1e9, 6.0, 7),
    (-0.75, -1.0, 10),
    (-5.0, -4.0, 14),
    (-100.0, -6.0, 15),
    (-0.1, -0.0, 8),  # rounds to negative zero
]


def test_e2m1_rne_table() -> None:
    x = torch.tensor([row[0] for row in E2M1_TABLE])
    codes = encode_e2m1(x)
    assert codes.tolist() == [row[2] for row in E2M1_TABLE]
    assert decode_e2m1(codes).tolist() == [row[1] for row in E2M1_TABLE]


def test_e2m1_packing_low_nibble_first() -> None:
    codes = torch.tensor([[1, 2, 3, 15], [7, 8, 0, 4]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0xF3], [0x87, 0x40]]
    assert torch.equal(unpack_e2m1(packed), codes)
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))


def _torch_pack_uint4():
    """torch's own `pack_uint4` as shipped in this build (torch/testing/_internal/common_quantized.py).

    The module cannot be imported without the test-only `expecttest` package, so the two small
    functions are taken from its source with `ast` and run as they are.
    """
    path = Path(torch.__file__).parent / "testing" / "_internal" / "common_quantized.py"
    if not path.exists():
        pytest.skip("this torch build does not ship common_quantized.py")
    tree = ast.parse(path.read_text())
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("down_size", "pack_uint4")]
    namespace: dict = {"torch": torch}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["pack_uint4"]


def test_e2m1_packing_matches_torch_convention() -> None:
    # torch's FP4x2 helper (used by its _scaled_mm tests for float4_e2m1fn_x2) packs
    # data[1::2] << 4 | data[::2]: element 2i in the low nibble, as we do.
    pack_uint4 = _torch_pack_uint4()
    codes = torch.randint(0, 16, (4, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pack_e2m1(codes), pack_uint4(codes))
