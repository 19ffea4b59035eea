"""Decode graphs' bookkeeping on CPU: capture sizes, padding, persistent inputs. The
padded static-buffer path runs eagerly here (``use_graphs=False``) and must give the
same tokens and logprobs as the unpadded eager steps; graph capture and replay
themselves are compared on the GPU (``test_gpu_worker.py``)."""

from __future__ import annotations

import pytest
import torch

from vtllm.protocol.messages import SamplingParams
from vtllm.worker.attention import write_kv_cache
from vtllm.worker.decode_graphs import capture_sizes, padded_size
from vtllm.worker.model_runner import ModelRunner
from vtllm.worker.platform import Platform, cpu_platform

from .tiny_models import VOCAB_SIZE, EngineSim, full_logprobs, make_hf_model


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    big = capture_sizes(300)
    assert big[:6] == [1, 2, 4, 8, 16, 24]
    assert big[-5:] == [248, 256, 272, 288, 300]
    assert big == sorted(set(big))
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        capture_sizes(0)


def test_padded_size():
    sizes = capture_sizes(40)
    padded = {n: padded_size(sizes, n) for n in (1, 2, 3, 5, 9, 16, 17, 40)}
    assert padded == {1: 1, 2: 2, 3: 4, 5: 8, 9: 16, 16: 16, 17: 24, 40: 40}
    assert padded_size(sizes, 41) is None


def test_padding_slots_are_not_written():
    k_cache = torch.zeros(4, 2, 1, 3)  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache = torch.zeros(4, 2, 1, 3)
    k = torch.arange(1.0, 10.0).view(3, 1, 3)
    write_kv_cache(k, -k, k_cache, v_cache, torch.tensor([5, -1, 2]))
    flat_k, flat_v = k_cache.view(8, 3), v_cache.view(8, 3)
    assert flat_k[5].tolist() == [1.0, 2.0, 3.0] and flat_k[2].tolist() == [7.0, 8.0, 9.0]
    assert flat_v[2].tolist() == [-7.0, -8.0, -9.0]
    assert int((flat_k != 0).any(dim=1).sum()) == 2  # nothing else written


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_hf_model("qwen3", path)
    return path


def run_scenario(
    model_dir,
    padded: bool,
    max_model_len: int = 64,
    platform: Platform | None = None,
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: torch.dtype | None = None,
):
    """Five requests (two seeded-sampled, three greedy) through prefill, decode steps at
    batch sizes 5, 4 and 2, a mixed prefill+decode step, and decodes past
    ``max_model_len`` (too wide for the buffers: eager). ``padded``: through decode
    graphs (real ones on a GPU ``platform``, the eager padded path on CPU). Returns the
    runner and every output."""
    platform = platform or cpu_platform()
    runner = ModelRunner.from_model_dir(
        model_dir, platform.device, dtype, seed=0, kv_cache_dtype=kv_cache_dtype
    )
    runner.init_kv_cache(num_blocks=128, block_size=4)
    runner.attention_backend = "triton"  # the kernel contract (its torch reference on CPU)
    if padded:
        use_graphs = platform.supports_graphs
        runner.capture_decode_graphs(platform, 6, max_model_len, use_graphs=use_graphs)
    engine = EngineSim(runner.execute, num_blocks=128, block_size=4)
    greedy = SamplingParams(temperature=0.0, logprobs=VOCAB_SIZE)
    seeded = SamplingParams(temperature=0.8, seed=7, logprobs=VOCAB_SIZE)
    prompts = {f"r{i}": [3 + i, 40 + 7 * i, 9, 100 + i][: 2 + i % 3] for i in range(5)}
    for i, (request_id, prompt) in enumerate(prompts.items()):
        engine.add(request_id, prompt * (1 + i), seeded if i < 2 else greedy)
    outputs = [engine.step({rid: len(r.token_ids) for rid, r in engine.requests.items()})]
    for step in range(70):
        if step == 4:
            engine.finish("r4")
        if step == 8:
            engine.finish("r3")
            engine.finish("r2")
        schedule = {rid: 1 for rid in engine.requests}
        if step == 12:  # a new request joins: one mixed step, eager in both runs
            engine.add("late", [5, 6, 7, 8, 9, 10], greedy)
            schedule["late"] = 6
        outputs.append(engine.step(schedule))
    return runner, outputs


def assert_same_outputs(eager, padded, atol: float) -> None:
    """Same requests, same sampled tokens, full-vocab logprobs within ``atol``."""
    for expected, actual in zip(eager, padded, strict=True):
        assert actual.request_ids == expected.request_ids
        assert actual.sampled_token_ids == expected.sampled_token_ids
        for i in range(len(expected.request_ids)):
            torch.testing.assert_close(
                full_logprobs(actual, i, VOCAB_SIZE),
                full_logprobs(expected, i, VOCAB_SIZE),
                atol=atol,
                rtol=0,
            )


def test_padded_static_path_matches_eager_steps(model_dir):
    _, eager = run_scenario(model_dir, padded=False)
    runner, padded = run_scenario(model_dir, padded=True)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 6]
    assert_same_outputs(eager, padded, atol=1e-5)


def test_decode_batches_take_the_padded_path_only_when_they_fit(model_dir):
    runner, _ = run_scenario(model_dir, padded=True, max_model_len=64)
    graphs = runner.decode_graphs
    calls: list[int] = []
    original = graphs.run
    graphs.run = lambda batch, feed=None: (
        calls.append(len(batch.query_lens)) or original(batch, feed)
    )
    engine = EngineSim(runner.execute, num_blocks=128, block_size=4, seed=3)
    greedy = SamplingParams(temperature=0.0)
    for i in range(7):
        engine.add(f"n{i}", [10 + i, 11, 12], greedy)
    engine.step({rid: 3 for rid in engine.requests})  # prefill: eager
    engine.step({rid: 1 for rid in engine.requests})  # 7 decodes > 6: eager
    engine.finish("n6")
    engine.step({rid: 1 for rid in engine.requests})  # 6 decodes: padded path
    assert calls == [6]


def test_capture_progress_is_logged_in_tenths(caplog):
    import logging

    from vtllm.log import ProgressLog

    progress = ProgressLog(logging.getLogger("test.progress"), "capturing decode graphs", 35)
    with caplog.at_level(logging.INFO, logger="test.progress"):
        for size in reversed(capture_sizes(256)):
            progress.advance(f"batch {size}")
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 11  # the first graph, each further tenth, the last
    assert lines[0].startswith("capturing decode graphs [----------] 1/35 (batch 256)")
    assert lines[-1].startswith("capturing decode graphs [##########] 35/35 (batch 1)")


def test_graph_length_and_switch_follow_the_config():
    from vtllm.config import VtllmConfig
    from vtllm.protocol.messages import InitKVCache
    from vtllm.worker.worker import _graph_max_len, _use_graphs

    config = VtllmConfig()
    init = InitKVCache(num_blocks=100, block_size=16)
    assert _graph_max_len(config, 40960, init) == 1600  # what the cache holds
    config.model.max_model_len = 512
    assert _graph_max_len(config, 40960, init) == 512
    runner = type("Runner", (), {"attention_backend": "triton"})()
    assert not _use_graphs(config, cpu_platform(), runner)  # no graphs on CPU
    from vtllm.worker.platform import PlatformKind

    gpu = Platform(PlatformKind.CUDA, torch.device("cuda", 0))  # only described, not used
    assert _use_graphs(config, gpu, runner)
    config.model.enforce_eager = True
    assert not _use_graphs(config, gpu, runner)
    config.model.enforce_eager = False
    runner.attention_backend = "torch"  # VT_ATTENTION_BACKEND=torch: no kernel, no graphs
    assert not _use_graphs(config, gpu, runner)


def test_short_batches_replay_the_unsplit_variant(tmp_path):
    """A size whose longest admitted sequence wants split-KV attention keeps an unsplit
    variant too, and a batch whose sequences are all short runs that one."""
    make_hf_model("qwen3", tmp_path, max_position_embeddings=4096)
    runner = ModelRunner.from_model_dir(tmp_path, torch.device("cpu"), torch.float32, seed=0)
    runner.init_kv_cache(num_blocks=1100, block_size=4)
    runner.attention_backend = "triton"
    graphs = runner.capture_decode_graphs(cpu_platform(), 2, 4096, use_graphs=False)
    # tiny qwen3: 2 KV heads; 4,096 keys afford 32 splits of >= 128 keys (the cap)
    assert graphs.split_counts(1) == [32, 1] and graphs.split_counts(2) == [32, 1]
    assert [graphs.split_count(1, n) for n in (1, 40, 255, 256, 4096)] == [1, 1, 1, 32, 32]
    ran: list[int] = []
    original = graphs.inputs.metadata
    graphs.inputs.metadata = lambda size, splits: ran.append(splits) or original(size, splits)
    engine = EngineSim(runner.execute, num_blocks=1100, block_size=4)
    greedy = SamplingParams(temperature=0.0)
    engine.add("short", [10, 11, 12], greedy)
    engine.step({"short": 3})  # prefill: eager
    engine.step({"short": 1})  # 4 keys: unsplit
    engine.add("long", [5 + i % 100 for i in range(1200)], greedy)
    engine.step({"long": 1200})
    engine.step({"short": 1, "long": 1})  # 1,201 keys: split
    assert ran == [1, 32]
