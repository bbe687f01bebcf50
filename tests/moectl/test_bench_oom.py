"""`moectl bench grouped-mlp` never dies of an out-of-memory: a path, a row or a whole shape that does not fit
is a marked cell, an error row and a note (fake OOMs injected on the CPU), and the fp8 error check runs at
a slice of the shape, comparing slab by slab."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from moectl.bench import grouped_mlp as gm
from moectl.bench.grouped_mlp import QUICK_SHAPES, Shape, error_check_shape, rel_err
from moectl.cli.app import app

OOM = "CUDA out of memory. Tried to allocate 14.00 GiB. GPU 0 has a total capacity of 79.1 GiB of which 13.2 GiB is free"
ARGS = ["bench", "grouped-mlp", "--quick", "--device", "cpu", "--no-permute", "--path", "eager", "--path", "grouped",
        "--path", "fused", "--path", "fp8_tensorwise", "--iters", "1", "--warmup", "0", "--sustained-seconds", "0"]  # fmt: skip


def _invoke(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner(env={"COLUMNS": "250"}).invoke(app, [*ARGS, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    return result.output, json.loads(out.read_text())


def test_oom_of_a_path_a_row_a_shape_and_the_error_check_are_reported(tmp_path, monkeypatch):
    first, second = QUICK_SHAPES
    real_fn, real_inputs, real_sustained = gm._expert_fn, gm._inputs, gm.sustained_ms

    def expert_fn(path, inp, spec, compiled):  # the grouped path does not fit at the first shape
        fn, weights = real_fn(path, inp, spec, compiled)
        if path == "grouped" and inp.x_TD.shape[0] == first.rows:
            def oom(*a):
                raise torch.OutOfMemoryError(OOM)
            return oom, weights
        return fn, weights

    calls = []

    def sustained(*a, **k):  # the first shape's fwd+bwd row runs out while timed
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError(OOM)
        return real_sustained(*a, **k)

    def inputs(shape, *a):  # the second shape's inputs do not fit
        if shape == second:
            raise torch.OutOfMemoryError(OOM)
        return real_inputs(shape, *a)

    monkeypatch.setattr(gm, "_expert_fn", expert_fn)
    monkeypatch.setattr(gm, "sustained_ms", sustained)
    monkeypatch.setattr(gm, "_inputs", inputs)
    output, data = _invoke(tmp_path)
    rows = data["rows"]
    assert [(r["shape"], r["pass"]) for r in rows] == [(s.label(), p) for s in QUICK_SHAPES for p in ("fwd", "fwd+bwd")]
    fwd, bwd, *second_rows = rows
    # a path: its cell says OOM, the other paths of the row are measured
    assert fwd["error"] is None and fwd["grouped_error"].startswith("out of memory: CUDA out of memory")
    assert fwd["grouped_ms"] is None and fwd["eager_ms"] > 0 and fwd["fused_ms"] > 0
    # a row: every number None, the reason kept
    assert bwd["error"].startswith("out of memory") and bwd["fused_ms"] is None and bwd["dense_row_tflops"] is None
    # a shape: both rows
    assert all(r["error"].startswith("out of memory") and r["eager_ms"] is None for r in second_rows)
    assert "OOM" in output and any(second.label() in n and "out of memory" in n for n in data["notes"])


def test_the_fp8_error_check_that_does_not_fit_leaves_the_timing(tmp_path, monkeypatch):
    def errors_at(*a):
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(gm, "_fp8_errors_at", errors_at)
    output, data = _invoke(tmp_path)
    for row in data["rows"]:
        assert row["fp8_tensorwise_ms"] > 0 and row["fp8_tensorwise_rel_err"]["error"].startswith("out of memory")
    assert "fp8_tensorwise OOM" in output


def test_error_check_shape_and_chunked_rel_err():
    # the shape that died on an 80 GB H100: the check now runs 8 of its 128 experts
    assert error_check_shape(Shape(128, 7168, 2048, 256)) == Shape(8, 7168, 2048, 256)
    assert error_check_shape(Shape(8, 4096, 14336, 2048)) == Shape(4, 4096, 14336, 2048)
    assert error_check_shape(Shape(1, 64, 96, 32)) == Shape(1, 64, 96, 16)
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(37, 5, 3, generator=g).bfloat16()
    got = (ref.float() + 0.01 * torch.randn(37, 5, 3, generator=g)).bfloat16()
    direct = float((got.float() - ref.float()).norm() / ref.float().norm())
    assert rel_err(got, ref, chunk_rows=4) == pytest.approx(direct, rel=1e-5)
    assert rel_err(ref, ref) == 0.0


@pytest.mark.gpu
def test_fp8_error_check_needs_less_memory_than_the_path_it_checks():
    """At (128,7168,2048,256), where the full-size check asked 14 GiB more than an 80 GB H100 had: the check's
    peak (its own inputs included) stays below one fwd+bwd of the fp8 path itself (inputs excluded)."""
    from moectl.bench import grouped_mlp_fp8 as fp8
    from trainer.moe.expert_math import ExpertSpec

    device, path = torch.device("cuda"), "fp8_tensorwise_pq_fa"
    shape = Shape(128, 7168, 2048, 256)
    cfg = gm.BenchConfig(shapes=(shape,), paths=("fused", path), device="cuda")
    spec = ExpertSpec("swiglu", shape.ffn, None)

    def peak_of(work) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        work()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    inp = gm._inputs(shape, 8, device, cfg.dtype, 0)
    fn, weights = fp8.expert_fn(path, inp, spec)
    dy = torch.randn(shape.rows, shape.hidden, device=device, dtype=cfg.dtype)
    path_peak = peak_of(gm._step(fn, inp, weights, False, True, dy))
    del inp, fn, weights, dy
    torch.cuda.empty_cache()
    errors = {}
    check_peak = peak_of(lambda: errors.update(gm._fp8_errors(shape, cfg, spec, [path], print)))
    assert set(errors[path]) == {"y", "dx", "dw1"} and all(0 < e < 0.1 for e in errors[path].values())
    assert check_peak < path_peak, (check_peak / 2**30, path_peak / 2**30)


CPU_OOM = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 41943040000000 bytes. Error code 12 (Cannot allocate memory)")


def test_the_cpu_allocators_failure_is_an_oom_too(tmp_path, monkeypatch):
    from moectl.bench.oom import is_oom, oom_message

    assert is_oom(RuntimeError(CPU_OOM)) and is_oom(torch.OutOfMemoryError(OOM))
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError(CPU_OOM))
    assert oom_message(RuntimeError(CPU_OOM)).startswith("out of memory: DefaultCPUAllocator: can't allocate memory")
    real_inputs = gm._inputs

    def inputs(shape, *a):  # the first shape does not fit in host memory (torch raises a plain RuntimeError)
        if shape == QUICK_SHAPES[0]:
            raise RuntimeError(CPU_OOM)
        return real_inputs(shape, *a)

    monkeypatch.setattr(gm, "_inputs", inputs)
    output, data = _invoke(tmp_path)
    errors = [r.get("error") for r in data["rows"] if r["shape"] == QUICK_SHAPES[0].label()]
    assert errors and all(e and e.startswith("out of memory: DefaultCPUAllocator") for e in errors)


def test_any_other_runtime_error_still_surfaces(monkeypatch):
    def inputs(shape, *a):
        raise RuntimeError("a bug")

    monkeypatch.setattr(gm, "_inputs", inputs)
    result = CliRunner(env={"COLUMNS": "250"}).invoke(app, ARGS)
    assert result.exit_code != 0 and isinstance(result.exception, RuntimeError)


def test_full_shapes_on_the_cpu_say_they_take_long_before_they_start(monkeypatch):
    class Started(Exception):
        pass

    def run(cfg, log):
        raise Started

    monkeypatch.setattr(gm, "run", run)
    result = CliRunner(env={"COLUMNS": "250"}).invoke(app, ["bench", "grouped-mlp", "--device", "cpu", "--no-fp8"])
    assert isinstance(result.exception, Started)
    assert "run for a long time on the CPU" in result.output and "--quick" in result.output
    result = CliRunner(env={"COLUMNS": "250"}).invoke(app, ["bench", "grouped-mlp", "--device", "cpu", "--quick"])
    assert isinstance(result.exception, Started) and "long time" not in result.output


def test_the_ceiling_on_the_cpu_is_cpu_sized_whatever_the_shapes(monkeypatch):
    """`--shape 2,16,16,16` on a CPU timed the GPU's dense 8192^3 ceiling first: minutes with nothing printed."""
    seen = []

    class Started(Exception):
        pass

    def run(cfg, log):
        seen.append(cfg.ceiling_size)
        raise Started

    monkeypatch.setattr(gm, "run", run)
    for extra in (["--shape", "2,16,16,16"], []):
        result = CliRunner(env={"COLUMNS": "250"}).invoke(app, ["bench", "grouped-mlp", "--device", "cpu", *extra])
        assert isinstance(result.exception, Started)
    assert seen == [1024, 1024] and gm.BenchConfig().ceiling_size == 8192  # the GPU's stays
