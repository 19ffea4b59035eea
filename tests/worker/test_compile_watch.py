"""The worker's watch on Triton compiles: start-up counts, and a line for each one a
serving step waits for (compile_watch.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vtllm.worker.compile_watch import CompileWatch, describe_specialisation, install

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _scaled_copy(src_ptr, dst_ptr, n, scale, BLOCK: tl.constexpr, FP8: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n) * scale, mask=offs < n)


def _source():
    """A compile source as Triton builds it: BLOCK=128, FP8=False, n divisible by 16."""
    from triton.compiler.compiler import ASTSource

    signature = {"src_ptr": "*fp32", "dst_ptr": "*fp32", "n": "i32", "scale": "fp32"}
    signature |= {"BLOCK": "constexpr", "FP8": "constexpr"}
    return ASTSource(
        _scaled_copy,
        signature,
        {"BLOCK": 128, "FP8": False},
        {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]},
    )


def test_startup_compiles_are_counted_and_serving_ones_are_each_a_line():
    watch = CompileWatch()
    assert watch.record("k1", 1.5, cache_hit=False) is None
    assert watch.record("k2", 0.01, cache_hit=True) is None
    assert watch.record("k3", 0.5, cache_hit=False) is None
    assert watch.startup_summary().startswith(
        "Triton at start-up: 2 kernel specialisations compiled (2.0s), 1 loaded"
    )
    watch.serving = True
    line = watch.record("_paged_attention_kernel[num_warps=4](TILE_N=32)", 1.25, False)
    assert line.startswith("a step waited 1.25s while Triton compiled _paged_attention_kernel")
    assert "(1 compiles, 1.2s, and 0 cache loads while serving so far)" in line
    line = watch.record("_rms_norm_kernel[num_warps=8]()", 0.004, True)
    assert "loaded from Triton's cache _rms_norm_kernel" in line
    assert "(1 compiles, 1.2s, and 1 cache loads" in line
    assert (watch.startup_compiled, watch.serving_compiled, watch.serving_loaded) == (2, 1, 1)


def test_a_specialisation_is_named_by_its_constexprs_and_divisible_arguments():
    text = describe_specialisation(_source(), {"name": "_scaled_copy", "num_warps": 4,
                                               "num_stages": 3})  # fmt: skip
    assert (
        text == "_scaled_copy[num_warps=4, num_stages=3](BLOCK=128, FP8=False; div16: src_ptr, n)"
    )
    # a source it cannot read is still a line, never an exception
    unreadable = describe_specialisation(SimpleNamespace(name="odd"), {})  # no .fn
    assert unreadable == "odd (AttributeError describing it)"


def test_install_chains_the_listener_and_logs_serving_compiles(caplog):
    from triton import knobs

    if not hasattr(getattr(knobs, "compilation", None), "listener"):
        pytest.skip("this Triton has no compilation listener")
    seen = []
    before = knobs.compilation.listener
    knobs.compilation.listener = lambda **kwargs: seen.append(kwargs["cache_hit"])
    try:
        watch = CompileWatch()
        assert install(watch)
        times = SimpleNamespace(total=800_000)  # µs
        metadata = {"name": "_scaled_copy", "num_warps": 4, "num_stages": 2}
        knobs.compilation.listener(src=_source(), metadata=metadata, metadata_group={},
                                   times=times, cache_hit=False)  # fmt: skip
        assert watch.startup_compiled == 1 and seen == [False]
        watch.serving = True
        with caplog.at_level(logging.INFO, logger="vtllm.worker.compile_watch"):
            knobs.compilation.listener(src=_source(), metadata=metadata, metadata_group={},
                                       times=times, cache_hit=False)  # fmt: skip
            # a broken source or times object is logged at DEBUG at most, never raised
            knobs.compilation.listener(src=None, metadata={}, metadata_group={},
                                       times=None, cache_hit=False)  # fmt: skip
        assert seen == [False, False, False]
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
        assert lines[0].startswith(
            "a step waited 0.80s while Triton compiled _scaled_copy[num_warps=4, num_stages=2]"
            "(BLOCK=128, FP8=False; div16: src_ptr, n)"
        )
    finally:
        knobs.compilation.listener = before


@pytest.mark.gpu
def test_gpu_a_kernel_first_met_while_serving_is_logged(caplog):
    """On a GPU: a specialisation first launched after start-up is one line (a compile at
    INFO, or a load from Triton's on-disk cache at DEBUG) naming the kernel."""
    import torch

    from vtllm.worker.platform import detect_platform

    if not detect_platform().is_gpu:
        pytest.skip("needs a CUDA or ROCm GPU")
    from triton import knobs

    before = knobs.compilation.listener
    try:
        watch = CompileWatch(serving=True)
        assert install(watch)
        x = torch.arange(300, dtype=torch.float32, device="cuda")
        y = torch.empty_like(x)
        with caplog.at_level(logging.DEBUG, logger="vtllm.worker.compile_watch"):
            _scaled_copy[(3,)](x, y, 300, 2.0, BLOCK=128, FP8=True)
        torch.testing.assert_close(y, 2 * x)
        assert watch.serving_compiled + watch.serving_loaded == 1
        (line,) = [r.getMessage() for r in caplog.records if "_scaled_copy[" in r.getMessage()]
        assert line.startswith("a step waited ") and "BLOCK=128, FP8=True" in line
    finally:
        knobs.compilation.listener = before
