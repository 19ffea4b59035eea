"""Tensor parallelism end to end on CPU (gloo): tiny random models served with
``--tensor-parallel-size 2`` give the same greedy completions over HTTP as with TP=1, really
run two worker processes, and each rank logs its own weights and KV cache.

Two models: a Llama and a Qwen3-MoE (top-2 of 4 experts with renormalised routing weights,
q/k norm, one dense layer; each expert's intermediate dim split over the ranks). Both have
4 heads / 2 KV heads (split over 2 ranks), hidden 64 and the SmolLM2 vocabulary (49152,
split over the vocab-parallel embedding and LM head), so the SmolLM2 tokenizer files are
copied next to them. Weights are drawn with a large init range so greedy choices are far
from ties; the two runs differ only in the order of the partial sums.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from tests.e2e.server import ServerProcess, cmdline, descendants

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]
NUM_TOKENS = 16


def _config(kind: str):
    """A tiny random config of ``kind`` whose heads, KV heads and (MoE) expert
    intermediate size all split over 2 ranks."""
    import transformers

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common, intermediate_size=128)
    if kind == "qwen3_moe":  # top-2 of 4 experts, renormalised; q/k norm; a dense layer
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=16,
            intermediate_size=96,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
    raise ValueError(kind)


def save_tiny_model(kind: str, model_dir: Path, smollm2_dir: Path) -> Path:
    """Write a random ``kind`` model (seed 0) and the SmolLM2 tokenizer to ``model_dir``."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
    model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, model_dir / name)
    return model_dir


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def tiny_model_dir(request, tmp_path_factory, smollm2_dir):
    model_dir = tmp_path_factory.mktemp(f"tiny_tp_{request.param}")
    return save_tiny_model(request.param, model_dir, smollm2_dir)


def _serve(model_dir, tp_size: int, *flags: str) -> ServerProcess:
    return ServerProcess(
        "--model",
        str(model_dir),
        "--tensor-parallel-size",
        str(tp_size),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "64MiB",
        *flags,
    ).start()


def _complete(server: ServerProcess, prompt: str) -> dict:
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def _assert_per_rank_memory_lines(log: str, world_size: int) -> None:
    """Each rank logs its weights and its KV cache (bytes, blocks) with its rank; every
    rank holds the number of blocks the engine core chose (64 MiB each on CPU)."""
    engine = re.search(r"EngineCore .*KV cache: (\d+) blocks of 16 tokens", log)
    assert engine, log
    for rank in range(world_size):
        where = rf"on cpu \(rank {rank} of {world_size}\)"
        weights = re.search(rf"Worker_TP{rank} .*weights: \d+\.\d\d GiB {where}", log)
        assert weights, log
        ready = re.search(
            rf"Worker_TP{rank} .*ready: (\d+) KV blocks of 16 tokens; KV cache 0\.06 GiB {where}",
            log,
        )
        assert ready and ready.group(1) == engine.group(1), log


def test_tp2_matches_tp1_greedy(tiny_model_dir):
    # start both before waiting on either: their start-ups overlap
    servers = {tp: _serve(tiny_model_dir, tp) for tp in (1, 2)}
    try:
        for server in servers.values():
            server.wait_healthy()
        titles = [cmdline(pid) for pid in descendants(servers[2].process.pid)]
        assert any("VTLLM::Worker_TP0" in t for t in titles), titles
        assert any("VTLLM::Worker_TP1" in t for t in titles), titles
        titles_tp1 = [cmdline(pid) for pid in descendants(servers[1].process.pid)]
        assert not any("VTLLM::Worker_TP1" in t for t in titles_tp1), titles_tp1
        for tp, server in servers.items():
            _assert_per_rank_memory_lines(server.log(), tp)
        completions = {tp: [_complete(s, p) for p in PROMPTS] for tp, s in servers.items()}
    except BaseException:
        for tp, server in servers.items():
            print(f"--- TP={tp} server log ---\n{server.log()}")
        raise
    finally:
        for server in servers.values():
            server.stop()
    for tp1, tp2 in zip(completions[1], completions[2], strict=True):
        assert tp2["choices"][0]["text"] == tp1["choices"][0]["text"]
        assert tp2["usage"] == tp1["usage"]
    # a model that ignored its input (weights not loaded) would say the same everywhere
    assert len({c["choices"][0]["text"] for c in completions[1]}) == len(PROMPTS)
    # random weights rarely pick EOS; at least some prompts must run the full length
    assert any(c["usage"]["completion_tokens"] == NUM_TOKENS for c in completions[1])


def test_tp2_with_async_scheduling_matches_tp1_greedy(tmp_path, smollm2_dir):
    """Rank 0 broadcasts each step's sampled ids: rank 1 feeds the same next inputs."""
    model_dir = save_tiny_model("llama", tmp_path / "tiny_tp_async", smollm2_dir)
    servers = {1: _serve(model_dir, 1), 2: _serve(model_dir, 2, "--async-scheduling")}
    try:
        for server in servers.values():
            server.wait_healthy()
        completions = {tp: [_complete(s, p) for p in PROMPTS] for tp, s in servers.items()}
    except BaseException:
        for tp, server in servers.items():
            print(f"--- TP={tp} server log ---\n{server.log()}")
        raise
    finally:
        for server in servers.values():
            server.stop()
    for tp1, tp2 in zip(completions[1], completions[2], strict=True):
        assert tp2["choices"][0]["text"] == tp1["choices"][0]["text"]
        assert tp2["usage"] == tp1["usage"]
    assert any(c["usage"]["completion_tokens"] == NUM_TOKENS for c in completions[2])
