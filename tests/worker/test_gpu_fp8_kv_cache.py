"""FP8 KV cache on the GPU (``-m gpu``): a model with an FP8 cache against the same model
with a bf16 cache (Qwen3-0.6B-shaped random bf16 weights; the real SmolLM2-135M-Instruct
where its package is installed), decode graphs over an FP8 cache, and the engine's
start-up line with the doubled KV capacity."""

from __future__ import annotations

import json
import logging
import socket

import pytest
import torch

from vtllm.bench import MODEL_SHAPES
from vtllm.config import VtllmConfig
from vtllm.engine_core.core_proc import start_engine
from vtllm.protocol import transport
from vtllm.worker.platform import detect_platform

from .kv_dtype_runs import compare_runs, greedy_run
from .tiny_models import make_hf_model

pytestmark = pytest.mark.gpu

NUM_DECODE_STEPS = 48


@pytest.fixture(scope="module")
def qwen3_shape_dir(tmp_path_factory):
    """Qwen3-0.6B dimensions, 4 layers, for dummy (random, seeded) weights."""
    path = tmp_path_factory.mktemp("qwen3-0.6b-4l")
    (path / "config.json").write_text(
        json.dumps(dict(MODEL_SHAPES["qwen3-0.6b"], num_hidden_layers=4))
    )
    return path


@pytest.fixture(scope="module")
def real_smollm2_dir(tmp_path_factory):
    gguf_convert = pytest.importorskip("vtllm.worker.loader.gguf_convert")
    try:
        return gguf_convert.resolve_model_dir(None, tmp_path_factory.mktemp("vt_cache"))
    except FileNotFoundError as e:  # the embedded GGUF package is not installed
        pytest.skip(str(e))


def _fp8_vs_bf16(model_dir, what: str, min_agree: float, max_mean: float) -> None:
    platform = detect_platform(0)
    fp8 = platform.fp8_dtype

    def run(kv_cache_dtype, graphs: bool, forced: list | None) -> list:
        return greedy_run(
            model_dir, platform, torch.bfloat16, kv_cache_dtype, NUM_DECODE_STEPS, graphs, forced
        )

    bf16_eager = run(None, graphs=False, forced=None)
    fp8_eager = run(fp8, graphs=False, forced=bf16_eager)
    agree, picks, worst, mean = compare_runs(bf16_eager, fp8_eager)
    print(
        f"\n{what}, fp8 ({fp8}) vs bf16 KV: {agree}/{picks} greedy picks agree, "
        f"|Δ logprob| of the bf16 pick: worst {worst:.4f}, mean {mean:.4f}"
    )
    assert agree >= min_agree * picks
    assert mean < max_mean
    fp8_graphs = run(fp8, graphs=True, forced=bf16_eager)
    agree_g, picks_g, worst_g, mean_g = compare_runs(fp8_eager, fp8_graphs)
    print(
        f"fp8 KV, decode graphs vs eager: {agree_g}/{picks_g} agree, worst {worst_g:.4f}, "
        f"mean {mean_g:.4f}"
    )
    assert agree_g >= 0.97 * picks_g
    assert worst_g < 0.1


def test_fp8_cache_follows_bf16_cache_realistic_shape(qwen3_shape_dir):
    """Accuracy of --kv-cache-dtype fp8 (scales 1.0) at Qwen3-0.6B's shape (4 layers,
    random bf16 weights: near-ties are common, so a pick may flip): over 6 prompts x
    (prefill + 48 teacher-forced decode steps) the FP8-cache run's greedy pick agrees with
    the bf16-cache run on >= 90 % of the steps, the bf16 pick's logprob moving by < 0.05
    on average; decode graphs over the FP8 cache agree with its eager run."""
    _fp8_vs_bf16(qwen3_shape_dir, "Qwen3-0.6B shape (4 layers, random)", 0.9, 0.05)


def test_real_model_fp8_cache_follows_bf16_cache(real_smollm2_dir):
    """The same on SmolLM2-135M-Instruct's real weights (bf16; it ships no KV scales) and
    English prompts: >= 90 % of greedy picks agree, mean |Δ logprob| < 0.06 (fp32 on CPU,
    benchmarks/kv_cache_dtype_accuracy.py: 278/294 and 0.043)."""
    _fp8_vs_bf16(real_smollm2_dir, "SmolLM2-135M-Instruct bf16", 0.9, 0.06)


def test_decode_graphs_over_an_fp8_cache_match_eager_steps(tmp_path):
    """The decode-graph scenario of test_decode_graphs (padding, batch changes, a mixed
    step, decodes too long for the buffers) with an FP8 cache: graphs vs eager."""
    from .test_decode_graphs import assert_same_outputs, run_scenario

    make_hf_model("qwen3", tmp_path)
    platform = detect_platform(0)
    fp8 = platform.fp8_dtype
    _, eager = run_scenario(tmp_path, False, 64, platform, kv_cache_dtype=fp8)
    runner, graphed = run_scenario(tmp_path, True, 64, platform, kv_cache_dtype=fp8)
    assert runner.kv_caches[0][0].dtype == fp8
    assert runner.decode_graphs is not None and runner.decode_graphs.use_graphs
    assert_same_outputs(eager, graphed, atol=1e-4)


def _start(model_dir, kv_cache_dtype: str, caplog) -> tuple[int, int, str]:
    """Start the engine's workers on ``model_dir`` with ``--kv-cache-dtype``; returns
    (KV blocks, bytes per token, the start-up KV line)."""
    config = VtllmConfig()
    config.model.model = str(model_dir)
    config.model.max_model_len = 2048
    config.model.enforce_eager = True
    config.model.load_format = "dummy"
    config.cache.gpu_memory_utilization = 0.3
    config.cache.kv_cache_dtype = kv_cache_dtype
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dist_address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vtllm"):
        executor, facts = start_engine(
            config,
            str(model_dir),
            transport.ipc_address(model_dir, f"workers-{kv_cache_dtype}.sock"),
            dist_address,
        )
        executor.shutdown()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache: "))
    per_token = int(line.split(" bytes/token")[0].rsplit(" ", 1)[1])
    return facts.num_blocks, per_token, line


def test_startup_line_shows_the_doubled_kv_capacity(qwen3_shape_dir, caplog):
    blocks_bf16, bytes_bf16, line_bf16 = _start(qwen3_shape_dir, "auto", caplog)
    blocks_fp8, bytes_fp8, line_fp8 = _start(qwen3_shape_dir, "fp8", caplog)
    print(f"\n{line_bf16}\n{line_fp8}")
    # K and V x 4 layers x 8 KV heads x head_dim 128 x (2 | 1) bytes
    assert (bytes_bf16, bytes_fp8) == (2 * 4 * 8 * 128 * 2, 2 * 4 * 8 * 128)
    assert "--kv-cache-dtype fp8" in line_fp8
    # the same memory budget (to the profiler's noise) holds twice the blocks
    assert 1.95 < blocks_fp8 / blocks_bf16 < 2.05
