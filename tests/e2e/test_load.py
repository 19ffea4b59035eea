"""Load: 200 concurrent streaming requests of random sizes, a third of them abandoned by
their clients mid-stream, twice. Every request completes or is cleanly aborted, the KV
pool drains back to full, and no process's resident memory grows in the second round."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.e2e.server import ServerProcess, cmdline, descendants, engine_utility

pytestmark = pytest.mark.slow

NUM_REQUESTS = 200


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random) -> str:
    body = {
        "prompt": " ".join(
            rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(1, 24))
        ),
        "max_tokens": rng.randint(1, 8),
        "temperature": rng.choice([0.0, 0.8]),
        "stream": True,
    }
    abandon = rng.random() < 0.33
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return f"http {response.status_code}"
        async for line in response.aiter_lines():
            if abandon and line.startswith("data: {"):
                return "abandoned"  # leaving the block closes the connection mid-stream
            if line.startswith("data: {") and '"error"' in line:
                return "error: " + json.loads(line[6:])["error"]["message"]
            if line == "data: [DONE]":
                return "done"
    return "closed without [DONE]"


async def one_round(url: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 10)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        return await asyncio.gather(*[one_request(client, url, rng) for _ in range(NUM_REQUESTS)])


def wait_drained(server: ServerProcess, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    stats = engine_utility(server, "get_stats")
    while time.monotonic() < deadline and (stats["num_running"] or stats["num_waiting"]):
        time.sleep(0.5)
        stats = engine_utility(server, "get_stats")
    return stats


def test_two_rounds_of_200_streams(smollm2_dir, vt_cache_dir):
    srv = ServerProcess("--kv-cache-memory", "256MiB", cache_dir=vt_cache_dir).start()
    try:
        srv.wait_healthy()
        pids = {cmdline(p).split()[0]: p for p in descendants(srv.process.pid)}
        pids["VTLLM::Frontend"] = srv.process.pid
        rss = []
        for round_index in range(2):
            outcomes = asyncio.run(one_round(srv.url, seed=round_index))
            assert all(o in ("done", "abandoned") for o in outcomes), [
                o for o in outcomes if o not in ("done", "abandoned")
            ][:5]
            assert outcomes.count("done") > NUM_REQUESTS // 2
            stats = wait_drained(srv)
            assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
            assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
            assert stats["kv_cache_usage"] == 0.0
            rss.append({name: rss_kib(pid) for name, pid in pids.items()})
        for name in rss[0]:
            grown = rss[1][name] - rss[0][name]
            # allow allocator noise, not a per-request leak (200 requests per round)
            assert grown < max(0.05 * rss[0][name], 20_000), (name, rss)
        assert httpx.get(f"{srv.url}/health").status_code == 200
    finally:
        srv.stop()
