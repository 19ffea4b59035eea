"""A worker that hangs never wedges the server: a frozen worker (SIGSTOP) is found by its
silent heartbeat, a step that never finishes by the step deadline. Either way the open
stream ends with an error event that says which, /health turns 503, and `vtllm serve`
exits non-zero so systemd restarts it."""

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


def _stream(srv: ServerProcess, events: list[str], started: threading.Event) -> None:
    body = {"prompt": "Tell me a story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def _errors(events: list[str]) -> list[str]:
    return [
        json.loads(e)["error"]["message"] for e in events if e.startswith("{") and '"error"' in e
    ]


def _health_until_exit(srv: ServerProcess, since: float, limit_s: float) -> list[int]:
    codes = []
    while srv.process.poll() is None and time.monotonic() - since < limit_s:
        with contextlib.suppress(httpx.HTTPError):
            codes.append(httpx.get(f"{srv.url}/health", timeout=1).status_code)
        time.sleep(0.1)
    return codes


def test_sigstopped_worker_is_detected_by_its_silent_heartbeat(smollm2_dir, vt_cache_dir):
    srv = ServerProcess(
        "--kv-cache-memory",
        "128MiB",
        cache_dir=vt_cache_dir,
        env={"VT_WORKER_HEARTBEAT_TIMEOUT_S": "3"},
    )
    with srv.serving():
        events: list[str] = []
        started = threading.Event()
        thread = threading.Thread(target=_stream, args=(srv, events, started))
        thread.start()
        assert started.wait(60), srv.tail()
        worker = next(p for p in descendants(srv.process.pid) if "Worker_TP0" in cmdline(p))
        stopped_at = time.monotonic()
        os.kill(worker, signal.SIGSTOP)
        thread.join(20)
        detected_s = time.monotonic() - stopped_at
        assert not thread.is_alive(), "the stream did not end after the worker froze"
        assert detected_s < 3 + 4, detected_s
        errors = _errors(events)
        assert errors, events[-3:]
        assert "sent no heartbeat" in errors[-1] and "stopped (SIGSTOP" in errors[-1], errors
        health = _health_until_exit(srv, stopped_at, 20)  # the server may already be gone
        assert all(code == 503 for code in health), health
        assert srv.wait_exit(20) != 0


def test_a_step_past_the_deadline_fails_requests_and_the_server(smollm2_dir, vt_cache_dir):
    srv = ServerProcess(
        "--kv-cache-memory",
        "128MiB",
        cache_dir=vt_cache_dir,
        env={"VT_TEST_WORKER_STEP_DELAY_S": "30", "VT_STEP_TIMEOUT_S": "2"},
    )
    with srv.serving():
        sent_at = time.monotonic()
        body = {"prompt": "Hello", "max_tokens": 4}
        response = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
        assert time.monotonic() - sent_at < 2 + 4
        assert response.status_code >= 500, response.text
        message = response.json()["error"]["message"]
        assert "did not finish within VT_STEP_TIMEOUT_S=2s" in message, message
        assert "workers are alive" in message
        health = _health_until_exit(srv, sent_at, 20)
        assert all(code == 503 for code in health), health
        assert srv.wait_exit(20) != 0
