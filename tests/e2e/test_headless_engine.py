"""`vtllm engine-core` headless: protocol clients and several frontends share one engine
core; a non-loopback tcp:// bind needs CurveZMQ keys, and only key holders get in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import ServerProcess, free_port
from vtllm.cli import main as vtllm_main
from vtllm.protocol import messages as m
from vtllm.protocol.client import EngineCoreClient, HandshakeError
from vtllm.protocol.transport import ClientKeys, ServerKeys

pytestmark = pytest.mark.slow


def _start_engine(args: list[str], cache_dir: Path) -> tuple[subprocess.Popen, Path]:
    log = Path(tempfile.mkstemp(prefix="vtllm-engine-", suffix=".log")[1])
    env = {**os.environ, "VT_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "vtllm.cli", "engine-core", "--kv-cache-memory", "128MiB", *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    return process, log


def _wait_ready(process: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "engine core ready at" in log.read_text():
            return
        assert process.poll() is None, log.read_text()
        time.sleep(0.2)
    raise AssertionError(log.read_text())


def _stop(process: subprocess.Popen) -> int:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
    return process.wait(20)


def test_non_loopback_tcp_without_keys_is_refused(smollm2_dir, vt_cache_dir):
    process, log = _start_engine(["--engine-address", f"tcp://0.0.0.0:{free_port()}"], vt_cache_dir)
    assert process.wait(60) != 0
    assert "refusing to bind" in log.read_text() and "vtllm keygen" in log.read_text()


def test_curve_secured_engine_serves_key_holders_only(smollm2_dir, vt_cache_dir, tmp_path):
    keys_file, client_file = tmp_path / "engine.key", tmp_path / "client.key"
    assert vtllm_main(["keygen", "server", "--out", str(keys_file)]) == 0
    assert (
        vtllm_main(
            [
                "keygen",
                "client",
                "--server",
                str(keys_file),
                "--name",
                "t",
                "--out",
                str(client_file),
            ]
        )
        == 0
    )
    stranger = ClientKeys.generate(ServerKeys.load(keys_file).public, "not-admitted")
    address = f"tcp://0.0.0.0:{free_port()}"
    process, log = _start_engine(
        ["--engine-address", address, "--engine-curve-key-file", str(keys_file)], vt_cache_dir
    )
    try:
        _wait_ready(process, log)
        local = address.replace("0.0.0.0", "127.0.0.1")
        with pytest.raises(HandshakeError):
            EngineCoreClient(local, "no-keys", timeout_s=3)
        with pytest.raises(HandshakeError):
            EngineCoreClient(local, "wrong-keys", timeout_s=3, curve_keys=stranger)
        client = EngineCoreClient(local, "holder", curve_keys=ClientKeys.load(client_file))
        client.add_request(
            "r", [1, 504, 3], m.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        )
        outputs = list(client.stream("r", timeout_s=60))
        assert sum(len(o.new_token_ids) for o in outputs) == 4
        assert outputs[-1].finish_reason == m.FinishReason.LENGTH
        client.close()
        # the HTTP frontend (asyncio client) with the same key file
        srv = ServerProcess(
            "--engine-address",
            local,
            "--engine-curve-key-file",
            str(client_file),
            cache_dir=vt_cache_dir,
        ).start()
        try:
            srv.wait_healthy()
            body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
            reply = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
        finally:
            srv.stop()
    finally:
        assert _stop(process) == 0, log.read_text()


def test_two_frontends_share_one_engine(smollm2_dir, vt_cache_dir, tmp_path):
    address = f"ipc://{tmp_path}/engine.sock"
    process, log = _start_engine(["--engine-address", address], vt_cache_dir)
    frontends = []
    try:
        _wait_ready(process, log)
        for _ in range(2):
            srv = ServerProcess("--engine-address", address, cache_dir=vt_cache_dir).start()
            frontends.append(srv)
        for srv in frontends:
            srv.wait_healthy()
        body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
        texts = [
            httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).json()["choices"][0][
                "text"
            ]
            for srv in frontends
        ]
        assert texts[0] and texts[0] == texts[1]
        # a protocol client beside them gets only its own outputs
        client = EngineCoreClient(address, "third")
        client.add_request("mine", [1, 504, 3], m.SamplingParams(temperature=0.0, max_tokens=2))
        assert {o.request_id for o in client.stream("mine", timeout_s=60)} == {"mine"}
        client.close()
    finally:
        for srv in frontends:
            srv.stop()
        assert _stop(process) == 0, log.read_text()
    assert not Path(address[len("ipc://") :]).exists(), "stale ipc socket"
