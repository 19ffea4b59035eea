"""Engine death: SIGKILL the engine core during a stream. The stream ends with an error
event, /health is 503 while the server winds down, and `vtllm serve` exits non-zero (so
systemd's Restart=on-failure restarts it)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.server import ServerProcess, cmdline, descendants

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("victim", ["VTLLM::EngineCore", "VTLLM::Worker_TP0"])
def test_sigkill_during_stream(victim, smollm2_dir, vt_cache_dir):
    srv = ServerProcess("--kv-cache-memory", "128MiB", cache_dir=vt_cache_dir).start()
    try:
        srv.wait_healthy()
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {
                "prompt": "Tell me a story.",
                "max_tokens": 2000,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        thread = threading.Thread(target=stream)
        thread.start()
        assert started.wait(60), srv.tail()
        pid = next(p for p in descendants(srv.process.pid) if victim in cmdline(p))
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        thread.join(15)
        assert not thread.is_alive(), "the stream did not end after the engine died"
        assert time.monotonic() - killed_at < 10
        errors = [json.loads(e) for e in events if e.startswith("{") and '"error"' in e]
        assert errors and errors[-1]["error"]["message"], events[-3:]
        health = []
        while srv.process.poll() is None and time.monotonic() - killed_at < 15:
            with contextlib.suppress(httpx.HTTPError):
                health.append(httpx.get(f"{srv.url}/health", timeout=1).status_code)
            time.sleep(0.1)
        assert all(code == 503 for code in health), health
        assert srv.wait_exit(15) != 0
    finally:
        srv.stop()
