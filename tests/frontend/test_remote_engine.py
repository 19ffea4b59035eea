"""``run_frontend`` against a remote engine core (no ``engine_alive`` probe, as
``vtllm serve --engine-address``): the engine's death is not the frontend's. Streams end
with an error event, ``/health`` is 503 with the reason, and when an engine core answers
at the same address again the frontend reconnects and serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.frontend.conftest import parse_sse
from tests.frontend.fake_engine import FakeEngine
from vtllm.config import VtllmConfig
from vtllm.protocol.transport import free_tcp_port

_RUN_REMOTE = (
    "import sys; from vtllm.config import VtllmConfig; from vtllm.frontend.app import run_frontend;"
    "sys.exit(run_frontend(VtllmConfig.from_bytes(sys.argv[1].encode()), sys.argv[2], sys.argv[3]))"
)


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code
    except httpx.TransportError:
        return 0


def _wait(predicate, timeout_s: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise AssertionError(f"{what} within {timeout_s}s:\n{proc.communicate()[0]}")
        time.sleep(0.05)


def test_remote_engine_death_is_survived_and_reconnected(tmp_path: Path, model_dir: Path):
    address = f"ipc://{tmp_path}/engine.sock"
    fake = FakeEngine(address, token_ids=[5, 6, 7]).start()
    config = VtllmConfig()
    config.frontend.port = free_tcp_port()
    url = f"http://127.0.0.1:{config.frontend.port}"
    env = {**os.environ, "VT_HEARTBEAT_INTERVAL_S": "0.1", "VT_HEARTBEAT_TIMEOUT_S": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN_REMOTE, config.to_bytes().decode(), str(model_dir), address],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    second = None
    try:
        _wait(lambda: _health(url) == 200, 20, "frontend not healthy", proc)
        fake.first_token_delay_s = 30  # the stream waits on the engine when it dies
        body: dict = {}

        def stream() -> None:
            payload = {"prompt": "Hi", "stream": True}
            r = httpx.post(f"{url}/v1/completions", json=payload, timeout=20)
            body["text"] = r.text

        reader = threading.Thread(target=stream)
        reader.start()
        _wait(lambda: len(fake.added) == 1, 10, "request not sent", proc)
        fake.send_dead("the engine core stopped (SIGTERM/SIGINT)")
        reader.join(15)
        assert not reader.is_alive()
        events = parse_sse(body["text"])
        error = json.loads(events[-2] if events[-1] == "[DONE]" else events[-1])["error"]
        assert "the engine core stopped" in error["message"], events
        fake.stop()
        # the frontend stays up, says why it cannot serve, and refuses requests meanwhile
        time.sleep(1.5)
        assert proc.poll() is None
        r = httpx.get(f"{url}/health", timeout=2)
        assert r.status_code == 503 and "reconnecting" in r.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}).status_code == 503
        # an engine core at the same address again: served
        second = FakeEngine(address, token_ids=[5, 6, 7]).start()
        _wait(lambda: _health(url) == 200, 10, "frontend did not reconnect", proc)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}, timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert len(second.added) == 1
    finally:
        proc.terminate()
        proc.wait(15)
        fake.stop()
        if second is not None:
            second.stop()
