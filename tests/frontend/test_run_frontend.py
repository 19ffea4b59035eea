"""``run_frontend`` as a real process: exits non-zero when the engine dies, 0 on SIGTERM;
and the frontend package never imports torch."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.frontend.fake_engine import FakeEngine
from vtllm.config import VtllmConfig

# The fake engine stands for a local engine core (an engine_alive probe is given): its
# death is final. Without a probe (a remote engine) see tests/frontend/test_remote_engine.py.
_RUN = (
    "import sys; from vtllm.config import VtllmConfig; from vtllm.frontend.app import run_frontend;"
    "sys.exit(run_frontend(VtllmConfig.from_bytes(sys.argv[1].encode()), sys.argv[2], sys.argv[3],"
    " engine_alive=lambda: True))"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_frontend(
    tmp_path: Path,
    model_dir: Path,
    token_ids: list[int] | None = None,
    shutdown_timeout: float = 30.0,
) -> tuple[FakeEngine, subprocess.Popen, str]:
    """``run_frontend`` in a subprocess against a FakeEngine (``token_ids``, default
    ``[5]``) in this process; returns once ``/health`` answers 200."""
    fake = FakeEngine(f"ipc://{tmp_path}/engine.sock", token_ids=token_ids or [5]).start()
    config = VtllmConfig()
    config.frontend.port = _free_port()
    config.engine.shutdown_timeout = shutdown_timeout
    env = {**os.environ, "VT_HEARTBEAT_INTERVAL_S": "0.1", "VT_LOG_LEVEL": "INFO"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN, config.to_bytes().decode(), str(model_dir), fake.address],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{config.frontend.port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return fake, proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            fake.stop()
            pytest.fail(f"frontend did not come up:\n{proc.communicate()[0]}")
        time.sleep(0.05)


def wait_exit(proc: subprocess.Popen, timeout_s: float = 10) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"frontend did not exit:\n{proc.communicate()[0]}")


def test_exits_nonzero_when_engine_dies(tmp_path: Path, model_dir: Path) -> None:
    fake, proc, url = start_frontend(tmp_path, model_dir)
    try:
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}).status_code == 200
        fake.send_dead("worker crashed")
        assert wait_exit(proc) == 1
    finally:
        fake.stop()


def test_metrics_alive_on_the_real_server(tmp_path: Path, model_dir: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    fake, proc, url = start_frontend(tmp_path, model_dir)
    try:
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}).status_code == 200
        r = httpx.get(f"{url}/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
        }
        model = ("model_name", "fake-model")
        success = ("vtllm:request_success_total", (("finished_reason", "stop"), model))
        assert samples[success] == 1
        assert samples[("vtllm:generation_tokens_total", (model,))] == 1
        assert samples[("vtllm:time_to_first_token_seconds_count", (model,))] == 1
    finally:
        proc.kill()
        proc.wait(10)
        fake.stop()


def test_sigterm_is_a_clean_stop(tmp_path: Path, model_dir: Path) -> None:
    fake, proc, _ = start_frontend(tmp_path, model_dir)
    try:
        proc.send_signal(signal.SIGTERM)
        assert wait_exit(proc) == 0
        deadline = time.monotonic() + 5
        while fake.goodbyes == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fake.goodbyes == 1
    finally:
        fake.stop()


def test_frontend_never_imports_torch() -> None:
    code = (
        "import sys, vtllm.frontend.app, vtllm.protocol.async_client;"
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
