"""Prefix caching and preemption with the real model and real processes.

A pool of 8 MiB holds 11 blocks of 16 tokens (10 usable, max_model_len fitted to 160):
three concurrent requests of 20 + 60 tokens need 15 blocks, so the engine must preempt
and recompute — and greedy outputs must not change.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.e2e.server import ServerProcess, engine_utility

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_kv_server(smollm2_dir, vt_cache_dir):
    # --quantization none: a preempted request prefills what it had decoded, and the CPU
    # int4 default decodes through other weights than it prefills (not batch-invariant)
    with ServerProcess(
        "--quantization", "none", "--kv-cache-memory", "8MiB", cache_dir=vt_cache_dir
    ).serving() as srv:
        yield srv


def _complete(server: ServerProcess, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "The three most important rules of writing software are",
    "Here is a recipe for a simple tomato soup. First,",
]


def test_preemption_keeps_greedy_outputs(tiny_kv_server):
    stats = engine_utility(tiny_kv_server, "get_stats")
    assert stats["num_total_blocks"] == 10
    alone = [_complete(tiny_kv_server, p, 60)["choices"][0]["text"] for p in PROMPTS]
    assert engine_utility(tiny_kv_server, "get_stats")["num_preemptions_total"] == 0
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda p: _complete(tiny_kv_server, p, 60), PROMPTS))
    stats = engine_utility(tiny_kv_server, "get_stats")
    assert stats["num_preemptions_total"] > 0, stats
    assert [r["choices"][0]["text"] for r in together] == alone
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_prefix_hit_computes_fewer_tokens_with_identical_output(tiny_kv_server):
    prompt = "Describe the water cycle in detail, step by step, for a class of students:"
    first = _complete(tiny_kv_server, prompt, 12)
    before = engine_utility(tiny_kv_server, "get_stats")
    second = _complete(tiny_kv_server, prompt, 12)
    after = engine_utility(tiny_kv_server, "get_stats")
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    num_prompt = second["usage"]["prompt_tokens"]
    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    assert hits == (num_prompt - 1) // 16 * 16 > 0
    details = second["usage"].get("prompt_tokens_details") or {}
    assert details.get("cached_tokens") == hits


def test_unset_max_tokens_runs_to_max_model_len(tiny_kv_server):
    """max_tokens -1 means unset: the context limit, never a hidden small constant."""
    body = {"prompt": "Count: one, two,", "max_tokens": -1, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{tiny_kv_server.url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 160
    assert response.json()["choices"][0]["finish_reason"] == "length"
