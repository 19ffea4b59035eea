"""`vtllm serve --engine-address` against a headless `vtllm engine-core` that is SIGKILLed
mid-stream, with the default heartbeat settings: the stream ends with an error event
within 10 s, the frontend stays up with /health 503, and when the engine core is started
again at the same address the frontend reconnects and serves."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.server import ServerProcess, free_port
from tests.e2e.test_headless_engine import _start_engine, _wait_ready

pytestmark = pytest.mark.slow


def _without_heartbeat_overrides() -> None:
    for name in ("VT_HEARTBEAT_INTERVAL_S", "VT_HEARTBEAT_TIMEOUT_S"):
        assert name not in os.environ, f"{name} is set: this test measures the defaults"


def test_killed_remote_engine_reaches_the_stream_and_comes_back(smollm2_dir, vt_cache_dir):
    _without_heartbeat_overrides()
    address = f"tcp://127.0.0.1:{free_port()}"
    engine, log = _start_engine(
        ["--engine-address", address, "--engine-allow-insecure-loopback"], vt_cache_dir
    )
    second = None
    srv = ServerProcess("--engine-address", address, cache_dir=vt_cache_dir)
    try:
        _wait_ready(engine, log)
        with srv.serving():
            events: list[str] = []
            started = threading.Event()
            ended_at: list[float] = []

            def stream() -> None:
                body = {"prompt": "Tell me a story.", "max_tokens": 2000, "ignore_eos": True}
                with httpx.stream(
                    "POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60
                ) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            event = line[6:]
                            if event.startswith("{") and "error" in json.loads(event):
                                ended_at.append(time.monotonic())
                            started.set()

            reader = threading.Thread(target=stream)
            reader.start()
            assert started.wait(60), srv.tail()
            os.kill(engine.pid, signal.SIGKILL)  # the engine core only: as a crash would
            killed_at = time.monotonic()
            reader.join(20)
            assert not reader.is_alive(), "the stream did not end after the engine died"
            assert ended_at, events[-3:]
            detection_s = ended_at[0] - killed_at
            print(f"killed remote engine core reached the stream in {detection_s:.2f}s")
            assert detection_s < 10
            error = json.loads(next(e for e in events if '"error"' in e))["error"]
            assert "silent for more than" in error["message"], error
            # the frontend stays up and says why it cannot serve
            r = httpx.get(f"{srv.url}/health", timeout=2)
            assert r.status_code == 503 and "reconnecting" in r.json()["error"]["message"]
            assert srv.process.poll() is None
            os.killpg(engine.pid, signal.SIGKILL)  # its workers, if any are left
            engine.wait(10)
            second, log = _start_engine(
                ["--engine-address", address, "--engine-allow-insecure-loopback"], vt_cache_dir
            )
            _wait_ready(second, log)
            srv.wait_healthy(30)
            body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
            reply = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"], reply.text
    finally:
        for process in (engine, second):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(20)
