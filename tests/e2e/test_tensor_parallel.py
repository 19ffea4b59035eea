"""Tensor parallelism end to end on CPU (gloo): a tiny random Llama-style model served with
``--tensor-parallel-size 2`` gives the same greedy completions over HTTP as with TP=1, and
really runs two worker processes.

The model has 4 heads / 2 KV heads (both split over 2 ranks), hidden 64 and the SmolLM2
vocabulary (49152, split over the vocab-parallel embedding and LM head), so the SmolLM2
tokenizer files are copied next to it. Its weights are drawn with a large init range so
greedy choices are far from ties; the two runs differ only in the order of the partial sums.
"""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch

from tests.e2e.server import ServerProcess, cmdline, descendants

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, smollm2_dir):
    import transformers

    model_dir = tmp_path_factory.mktemp("tiny_tp_llama")
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, model_dir / name)
    return model_dir


def _serve(model_dir, tp_size: int) -> ServerProcess:
    return ServerProcess(
        "--model",
        str(model_dir),
        "--tensor-parallel-size",
        str(tp_size),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "64MiB",
    ).start()


def _complete(server: ServerProcess, prompt: str) -> dict:
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


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
    # random weights rarely pick EOS; at least some prompts must run the full length
    assert any(c["usage"]["completion_tokens"] == NUM_TOKENS for c in completions[1])
