"""``--async-scheduling`` through real processes and HTTP (the embedded SmolLM2 on the
CPU): greedy outputs are the same as a server without it — with max_tokens, stop
strings, n > 1 and EOS ending requests mid-flight — requests preempted in a tiny KV cache
and aborted mid-stream leave the engine serving with every block back in the pool.

A pool of 8 MiB holds 10 usable blocks of 16 tokens (max_model_len fitted to 160), as in
``test_engine_behaviour.py``: three concurrent requests of ~12 + 44 tokens need 12.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.e2e.server import ServerProcess, engine_utility

pytestmark = pytest.mark.slow

# --quantization none: the CPU int4 path decodes through other weights than it prefills,
# so a preempted request's recompute would not be batch-invariant
FLAGS = ("--quantization", "none", "--kv-cache-memory", "8MiB")
PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "The three most important rules of writing software are",
    "Here is a recipe for a simple tomato soup. First,",
]


@pytest.fixture(scope="module")
def servers(smollm2_dir, vt_cache_dir):
    with (
        ServerProcess(*FLAGS, cache_dir=vt_cache_dir).serving() as sync_server,
        ServerProcess(*FLAGS, "--async-scheduling", cache_dir=vt_cache_dir).serving() as srv,
    ):
        yield sync_server, srv


def _complete(server: ServerProcess, **body) -> dict:
    body = {"temperature": 0, **body}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def _choices(result: dict) -> list[tuple[str, str]]:
    return [(c["text"], c["finish_reason"]) for c in result["choices"]]


BODIES = [
    {"prompt": PROMPTS[0], "max_tokens": 1},
    {"prompt": PROMPTS[0], "max_tokens": 2},
    {"prompt": PROMPTS[1], "max_tokens": 12},
    {"prompt": PROMPTS[2], "max_tokens": 16, "stop": [","]},
    {"prompt": "What is 2 + 2? Answer with one number.", "max_tokens": 16},
    {"prompt": PROMPTS[1], "max_tokens": 8, "n": 2, "seed": 3, "temperature": 0.8},
]


def test_outputs_identical_to_a_server_without_it(servers):
    sync_server, async_server = servers
    for body in BODIES:
        expected = _choices(_complete(sync_server, **body))
        assert _choices(_complete(async_server, **body)) == expected, body
    stats = engine_utility(async_server, "get_stats")
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_preemption_and_abort_mid_stream(servers):
    _, server = servers
    alone = [_complete(server, prompt=p, max_tokens=44, ignore_eos=True) for p in PROMPTS]
    before = engine_utility(server, "get_stats")["num_preemptions_total"]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = list(
            pool.map(lambda p: _complete(server, prompt=p, max_tokens=44, ignore_eos=True), PROMPTS)
        )
    stats = engine_utility(server, "get_stats")
    assert stats["num_preemptions_total"] > before, stats
    assert [_choices(r) for r in together] == [_choices(r) for r in alone]
    # a client that goes away mid-stream aborts its request; its blocks come back
    body = {"prompt": PROMPTS[0], "max_tokens": 120, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 5:
                break
    deadline = time.monotonic() + 30
    while True:
        stats = engine_utility(server, "get_stats")
        if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    again = _complete(server, prompt=PROMPTS[2], max_tokens=44, ignore_eos=True)
    assert _choices(again) == _choices(alone[2])
