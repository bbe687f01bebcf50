"""The batched FP8 transpose (`trainer/kernels/fp8_transpose_triton.py`) against the eager copy, bitwise.

CPU: the torch path everywhere, and no Triton import for CPU tensors. The Triton kernel itself runs on CPU
tensors under the interpreter (`PYTHONPATH=<triton> TRITON_INTERPRET=1 pytest ...`; skipped without
Triton, as in CI) and on CUDA (`gpu` marker), where per-tensor FP8 columnwise copies go through it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from trainer.kernels import fp8_transpose_triton as ft
from trainer.precision.blocks import transposed

# odd sizes and tile edges, a batch of experts, degenerate dims
SHAPES = [(5, 7), (64, 64), (65, 130), (3, 65, 130), (2, 1, 64), (2, 128, 1), (2, 3, 17, 9), (0, 4, 4)]
DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8]


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(device).view(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous() and torch.equal(
        a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cpu_tensors_take_the_torch_path(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = _random(shape, dtype)
    assert _same(ft.transpose_last2(x), transposed(x))
    assert _same(ft.transpose_last2(x, "torch"), transposed(x))


def test_no_triton_import_for_cpu_tensors() -> None:
    code = ("import sys, torch\nfrom trainer.kernels.fp8_transpose_triton import transpose_last2\n"
            "transpose_last2(torch.zeros(4, 8, dtype=torch.uint8))\nassert 'triton' not in sys.modules\n")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rejects_wide_elements_in_the_kernel() -> None:
    if not ft.triton_available():
        with pytest.raises(RuntimeError, match="needs Triton"):
            ft.transpose_triton(torch.zeros(4, 4, dtype=torch.uint8))
        return
    with pytest.raises(ValueError, match="1-byte"):
        ft.transpose_triton(torch.zeros(4, 4, dtype=torch.bfloat16))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("tile", [ft.DEFAULT_TILE, (16, 32, 2), (128, 128, 8)], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_under_the_interpreter(shape: tuple[int, ...], tile: tuple[int, int, int]) -> None:
    pytest.importorskip("triton")
    x = _random(shape, torch.float8_e4m3fn)
    assert _same(ft.transpose_triton(x, tile), transposed(x))
    assert _same(ft.transpose_triton(x.transpose(-2, -1), tile), transposed(x.transpose(-2, -1)))  # strided in


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles the kernel (no interpreter)")
@pytest.mark.parametrize(("M", "K", "load", "store"), [(1488, 2048, "v4.b32", "v4.b32"), (2048, 744, "v2.b32", "v4.b32"),
                                                       (96, 7, "b8", "v4.b32")])  # fmt: skip
def test_kernel_compiles_to_vector_accesses_for_hopper(M: int, K: int, load: str, store: str) -> None:
    """No GPU needed: the sm_90 PTX moves whole vectors along rows whenever the row length allows it (fc2's
    K = 744 only 8-byte ones); a kernel moving single bytes runs far below the bandwidth."""
    import re

    pytest.importorskip("triton")
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # another Triton version's compiler API
        pytest.skip(f"Triton's compile API: {e}")
    bm, bk, warps = ft.DEFAULT_TILE
    sig = {"x_ptr": "*u8", "y_ptr": "*u8", "m_units": "i32", "k_units": "i32", "tiles_k": "i32",
           "BLOCK_M": "constexpr", "BLOCK_K": "constexpr", "ALIGN_M": "constexpr", "ALIGN_K": "constexpr"}
    consts = {"BLOCK_M": bm, "BLOCK_K": bk, "ALIGN_M": ft._alignment(M), "ALIGN_K": ft._alignment(K)}
    aligned = [["tt.divisibility", 16]]  # torch allocations: what Triton specialises pointers to at launch
    src = ASTSource(fn=ft._kernel(), signature=sig, constexprs=consts, attrs={(0,): aligned, (1,): aligned})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
    assert set(re.findall(r"ld\.global\.([\w.]+)", ptx)) == {load}
    assert set(re.findall(r"st\.global\.([\w.]+)", ptx)) == {store}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", SHAPES + [(16, 1488, 2048), (16, 2048, 744), (3072, 2048), (70_000, 2, 64)],
                         ids=str)  # fmt: skip
def test_kernel_on_gpu(shape: tuple[int, ...]) -> None:
    pytest.importorskip("triton")
    x = _random(shape, torch.float8_e4m3fn, "cuda")
    assert _same(ft.transpose_last2(x), transposed(x))  # auto: Triton on CUDA (70k matrices: two launches)
    for tile in ((16, 32, 2), (128, 128, 8)):
        assert _same(ft.transpose_triton(x, tile), transposed(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_per_tensor_columnwise_copies_use_the_kernel_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from trainer.precision import QuantizedData, QuantizedTensor, quantize
    from trainer.precision.recipes import TensorwiseRecipe

    calls: list[tuple[int, ...]] = []
    real = ft.transpose_triton
    monkeypatch.setattr(ft, "transpose_triton", lambda x, *a: calls.append(tuple(x.shape)) or real(x, *a))
    w = torch.randn(4, 96, 160, device="cuda", dtype=torch.bfloat16)
    scheme = TensorwiseRecipe().weight_scheme()
    both = quantize(w, scheme, rowwise=True, columnwise=True)
    row = both.copy("rowwise")
    lazy = QuantizedTensor(scheme, w.shape, w.dtype, rowwise=QuantizedData(row.data, row.scale)).with_columnwise()
    assert calls and calls[-1] == (4, 96, 160)
    assert _same(lazy.copy("columnwise").data, both.copy("columnwise").data)
    assert torch.equal(lazy.copy("columnwise").scale, both.copy("columnwise").scale)
