"""The worker's watch on Triton compiles: start-up counts, and a line for each one a
serving step waits for (compile_watch.py)."""

from __future__ import annotations

import ast
import inspect
import logging
from types import SimpleNamespace

import pytest

from vtllm.worker.compile_watch import CompileWatch, describe_specialisation, install

from .kernels.kernel_inventory import kernel_functions

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


# Integer arguments that follow the step (how many sequences, tokens, expert pairs): Triton
# compiles a kernel again for each class of such a value (1, a multiple of 16, other), so
# unless a kernel opts out (``do_not_specialize``) a serving step compiles whenever one
# first lands in a class start-up did not run.
STEP_SIZED = {"num_seqs", "num_tokens", "num_pairs", "max_blocks", "m", "M"}
SPECIALISED_ON_PURPOSE = {
    # batches of at most 16 rows, nearly always inside decode graphs captured at start-up
    # for every size; M == 1 keeps batch 1's code free of the row masks
    "_gemv_kernel": {"M"},
    # decode-sized batches; its BLOCK_T constexpr (next power of two of num_tokens) keys a
    # compile per size class already
    "_moe_router_route_kernel": {"num_tokens"},
}


def _not_specialised(kernel) -> set[str]:
    """The names in the kernel's ``@triton.jit(do_not_specialize=[...])`` (from its source:
    the interpreter's stand-in keeps no such attribute)."""
    tree = ast.parse(inspect.getsource(kernel.fn).lstrip())
    (function,) = tree.body
    names: set[str] = set()
    for decorator in function.decorator_list:
        for keyword in getattr(decorator, "keywords", []):
            if keyword.arg == "do_not_specialize":
                names |= {ast.literal_eval(element) for element in keyword.value.elts}
    return names


def test_step_sized_kernel_arguments_are_not_specialised():
    checked = 0
    for name, kernel in sorted(kernel_functions().items()):
        params = inspect.signature(kernel.fn).parameters.values()
        runtime = [p.name for p in params if "constexpr" not in str(p.annotation)]
        opted_out = _not_specialised(kernel)
        assert opted_out <= set(runtime), f"{name}: do_not_specialize names no argument"
        for arg in STEP_SIZED.intersection(runtime):
            if arg in SPECIALISED_ON_PURPOSE.get(name, ()):
                continue
            checked += 1
            assert arg in opted_out, (
                f"{name}({arg}) is step-sized: add it to do_not_specialize, or to "
                "SPECIALISED_ON_PURPOSE with why"
            )
    assert checked >= 7  # attention, split reduction, FP8 matmul, fused MoE, MoE align x3


@pytest.mark.gpu
def test_gpu_steps_of_any_size_meet_no_new_attention_specialisation(caplog):
    """On a GPU: once one mixed and one decode-only step have run, steps of other sequence
    counts and widest tables (1, a multiple of 16, other) compile and load nothing."""
    import torch

    from vtllm.worker.attention import build_attention_metadata
    from vtllm.worker.kernels.paged_attention import paged_attention
    from vtllm.worker.platform import detect_platform

    if not detect_platform().is_gpu:
        pytest.skip("needs a CUDA or ROCm GPU")
    from triton import knobs

    device = torch.device("cuda")
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    shape = (40 * 33, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)

    def step(query_lens: list[int], seq_lens: list[int]) -> None:
        tables = [list(range(40 * r, 40 * r + -(-s // block_size))) for r, s in enumerate(seq_lens)]
        inputs = build_attention_metadata(
            query_lens, seq_lens, tables, block_size, device, "triton", first_chunk_min_tokens=None
        ).kernel_inputs
        q = torch.randn(sum(query_lens), num_heads, head_dim, dtype=torch.bfloat16, device=device)
        out = paged_attention(q, k_cache, v_cache, inputs.query_start_loc, inputs.seq_lens,
                              inputs.block_tables, head_dim**-0.5, num_kv_splits=1)  # fmt: skip
        assert torch.isfinite(out).all()

    step([5, 1, 1], [40, 9, 33])  # a mixed step and a decode-only one: what start-up runs
    step([1, 1, 1], [40, 9, 33])
    torch.cuda.synchronize()
    before = knobs.compilation.listener
    try:
        watch = CompileWatch(serving=True)
        assert install(watch)
        with caplog.at_level(logging.DEBUG, logger="vtllm.worker.compile_watch"):
            for num_seqs in (1, 2, 16, 17, 32, 33):
                widest = 16 * num_seqs  # widest table: num_seqs blocks
                seq_lens = [widest] + [1 + r for r in range(1, num_seqs)]
                step([3] + [1] * (num_seqs - 1), seq_lens)
                step([1] * num_seqs, seq_lens)
            torch.cuda.synchronize()
        met = [r.getMessage() for r in caplog.records if "a step waited" in r.getMessage()]
        assert watch.serving_compiled + watch.serving_loaded == 0, met
    finally:
        knobs.compilation.listener = before
