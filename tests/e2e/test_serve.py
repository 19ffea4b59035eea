"""`vtllm serve` end to end: real processes, real HTTP, the real embedded model."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import QUESTION
from tests.e2e.server import ServerProcess, cmdline, descendants, is_alive

pytestmark = pytest.mark.slow


def test_chat_answers_paris(client, model):
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0)
    text = reply.choices[0].message.content
    assert "Paris" in text, text
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    assert reply.choices[0].finish_reason == "stop"


def test_stream_equals_non_stream(client, model):
    kwargs = dict(model=model, messages=QUESTION, temperature=0, max_tokens=24)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full


def test_completions_endpoint(client, model):
    reply = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert reply.choices[0].text
    assert reply.usage.completion_tokens <= 8


def test_eight_concurrent_requests_complete(server, model):
    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=180)
        prompts = [f"Count from {i} to {i + 5}." for i in range(8)]
        replies = await asyncio.gather(
            *[
                aclient.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": p}],
                    max_tokens=16,
                    temperature=0,
                )
                for p in prompts
            ]
        )
        await aclient.close()
        return [r.choices[0].finish_reason for r in replies]

    reasons = asyncio.run(run())
    assert len(reasons) == 8 and all(r in ("stop", "length") for r in reasons)


def test_sigterm_stops_every_process(smollm2_dir, vt_cache_dir):
    srv = ServerProcess("--kv-cache-memory", "256MiB", cache_dir=vt_cache_dir).start()
    try:
        srv.wait_healthy()
        pids = descendants(srv.process.pid)
        titles = [cmdline(p) for p in pids]
        assert any("VTLLM::EngineCore" in t for t in titles), titles
        assert any("VTLLM::Worker_TP0" in t for t in titles), titles
        assert "VTLLM::Frontend" in cmdline(srv.process.pid)
        match = re.search(r"engine core ready at ipc://(\S+)", srv.log())
        assert match, srv.tail()
        socket_path = Path(match.group(1))
        assert socket_path.exists()
        os.kill(srv.process.pid, signal.SIGTERM)  # the main process only, as `kill` does
        code = srv.wait_exit(15)
        assert code == 0, srv.tail()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(is_alive(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if is_alive(p)], "orphaned processes"
        assert not socket_path.parent.exists(), "stale ipc runtime dir"
    finally:
        srv.stop()


@pytest.mark.parametrize("how", ["sigterm-main", "sigint-group"])
def test_a_stop_during_start_up_stops_every_process_first(how, smollm2_dir, vt_cache_dir):
    """A stop while the worker is still starting (systemctl stop, Ctrl-C during a long
    model load): the main process stops the engine core, which stops the worker, and
    exits 0 only after both; nothing waits for the start-up to end, nothing outlives it."""
    srv = ServerProcess("--kv-cache-memory", "64MiB", cache_dir=vt_cache_dir).start()
    try:
        deadline = time.monotonic() + 120
        pids: list[int] = []
        while time.monotonic() < deadline and srv.process.poll() is None:
            pids = descendants(srv.process.pid)
            if any("VTLLM::Worker_TP0" in cmdline(p) for p in pids):
                break
            time.sleep(0.02)
        assert any("VTLLM::EngineCore" in cmdline(p) for p in pids), srv.tail()
        if how == "sigterm-main":
            os.kill(srv.process.pid, signal.SIGTERM)  # `kill PID`: the main process only
        else:
            os.killpg(srv.process.pid, signal.SIGINT)  # Ctrl-C: the whole process group
        assert srv.wait_exit(30) == 0, srv.tail()
        assert not {p: cmdline(p) for p in pids if is_alive(p)}, srv.tail()
        name = "SIGTERM" if how == "sigterm-main" else "SIGINT"
        log = srv.log()
        assert f"{name} before the server was up: stopping the engine core" in log, srv.tail()
        assert "during start-up: workers stopped, engine core exiting" in log, srv.tail()
    finally:
        srv.stop()


def test_json_logs(smollm2_dir, vt_cache_dir):
    import json

    srv = ServerProcess(
        "--kv-cache-memory", "64MiB", "--log-format", "json", cache_dir=vt_cache_dir
    ).start()
    try:
        srv.wait_healthy()
    finally:
        srv.stop()
    lines = [line for line in srv.log().splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    processes = {e["process"] for e in entries}
    assert {"VTLLM::Frontend", "VTLLM::EngineCore", "VTLLM::Worker_TP0"} <= processes, processes
    assert any("engine core ready" in e["message"] for e in entries)
